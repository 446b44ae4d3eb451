//! Where a text sits in a provider's JSON: a [`Location`], a path of
//! [`Step`]s from the root of an answer or event, kept in a few dozen bytes
//! because every text field of every stream event carries one by value.
//! Members are named by [`Key`], the member names some wire format reads
//! text under; a name known only at run time is reached by its position.

use serde_json::Value;

/// Most steps from the root of a JSON value to a text field.
const MAX_STEPS: usize = 16;

/// A member name that text sits under in some wire format's JSON: every
/// name a [`Location`] steps into by name. A name only known at run time is
/// reached by its position instead ([`Step::Member`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Key {
    /// `arguments`
    Arguments,
    /// `choices`
    Choices,
    /// `content`
    Content,
    /// `content_block`
    ContentBlock,
    /// `delta`
    Delta,
    /// `function`
    Function,
    /// `function_call`
    FunctionCall,
    /// `logprobs`
    Logprobs,
    /// `message`
    Message,
    /// `output`
    Output,
    /// `partial_json`
    PartialJson,
    /// `reasoning`
    Reasoning,
    /// `reasoning_content`
    ReasoningContent,
    /// `refusal`
    Refusal,
    /// `response`
    Response,
    /// `summary`
    Summary,
    /// `text`
    Text,
    /// `thinking`
    Thinking,
    /// `tool_calls`
    ToolCalls,
}

impl Key {
    /// Every key, in the order of their codes in a packed step.
    const ALL: [Key; 19] = [
        Key::Arguments,
        Key::Choices,
        Key::Content,
        Key::ContentBlock,
        Key::Delta,
        Key::Function,
        Key::FunctionCall,
        Key::Logprobs,
        Key::Message,
        Key::Output,
        Key::PartialJson,
        Key::Reasoning,
        Key::ReasoningContent,
        Key::Refusal,
        Key::Response,
        Key::Summary,
        Key::Text,
        Key::Thinking,
        Key::ToolCalls,
    ];

    /// The member's name in the JSON.
    pub const fn name(self) -> &'static str {
        match self {
            Key::Arguments => "arguments",
            Key::Choices => "choices",
            Key::Content => "content",
            Key::ContentBlock => "content_block",
            Key::Delta => "delta",
            Key::Function => "function",
            Key::FunctionCall => "function_call",
            Key::Logprobs => "logprobs",
            Key::Message => "message",
            Key::Output => "output",
            Key::PartialJson => "partial_json",
            Key::Reasoning => "reasoning",
            Key::ReasoningContent => "reasoning_content",
            Key::Refusal => "refusal",
            Key::Response => "response",
            Key::Summary => "summary",
            Key::Text => "text",
            Key::Thinking => "thinking",
            Key::ToolCalls => "tool_calls",
        }
    }
}

/// One step into a JSON value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// A member of an object, by name.
    Key(Key),
    /// An element of an array.
    Index(usize),
    /// The member at this position of an object (members keep the order
    /// they were read in): for names known only at run time.
    Member(usize),
    /// The name of the member at this position of an object: a string
    /// that can be read ([`Location::text`]) but not replaced. Last step
    /// only.
    Name(usize),
}

/// A [`Step`] in 4 bytes, as a [`Location`] holds it: the kind of step in
/// the top two bits, the key's code or the position below them. Every
/// stream event moves its locations by value, so they are kept small.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PackedStep(u32);

impl PackedStep {
    const KIND_SHIFT: u32 = 30;
    /// Largest position a packed step holds: an array or object this long
    /// would take gigabytes of JSON and tens of gigabytes parsed.
    const MAX_POSITION: usize = (1 << Self::KIND_SHIFT) - 1;
    const KEY: u32 = 0;
    const INDEX: u32 = 1;
    const MEMBER: u32 = 2;
    const NAME: u32 = 3;

    /// `step` packed, or `None` for a position over [`Self::MAX_POSITION`].
    fn new(step: Step) -> Option<Self> {
        let (kind, payload) = match step {
            Step::Key(key) => (Self::KEY, key as usize),
            Step::Index(index) => (Self::INDEX, index),
            Step::Member(position) => (Self::MEMBER, position),
            Step::Name(position) => (Self::NAME, position),
        };
        (payload <= Self::MAX_POSITION).then_some(Self((kind << Self::KIND_SHIFT) | payload as u32))
    }

    fn unpack(self) -> Step {
        let payload = (self.0 & Self::MAX_POSITION as u32) as usize;
        match self.0 >> Self::KIND_SHIFT {
            Self::KEY => Step::Key(Key::ALL[payload]),
            Self::INDEX => Step::Index(payload),
            Self::MEMBER => Step::Member(payload),
            _ => Step::Name(payload),
        }
    }
}

/// Where a value sits inside a JSON value: up to [`MAX_STEPS`] steps from
/// its root. Copied, never allocated: every text field of every stream event
/// has one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    steps: [PackedStep; MAX_STEPS],
    /// Steps taken; [`Location::NOWHERE`] for a location that cannot be
    /// held.
    len: u8,
    /// The string there is read, never written ([`Location::read_only`]).
    read_only: bool,
}

impl Location {
    /// The root itself.
    pub const ROOT: Self = Self {
        steps: [PackedStep(0); MAX_STEPS],
        len: 0,
        read_only: false,
    };

    /// The `len` of a location past the last element a step can name: it
    /// points at nothing.
    const NOWHERE: u8 = u8::MAX;

    /// One step further: `step`. Deeper than [`MAX_STEPS`] is a bug of the
    /// wire format that builds it (it would point at the wrong value); a
    /// position no step holds makes a location that points at nothing.
    pub fn then(mut self, step: Step) -> Self {
        if self.len == Self::NOWHERE {
            return self;
        }
        let len = usize::from(self.len);
        assert!(
            len < MAX_STEPS,
            "a Location holds at most {MAX_STEPS} steps"
        );
        match PackedStep::new(step) {
            Some(packed) => {
                self.steps[len] = packed;
                self.len += 1;
            }
            None => self.len = Self::NOWHERE,
        }
        self
    }

    /// Member `key`.
    pub fn key(self, key: Key) -> Self {
        self.then(Step::Key(key))
    }

    /// Element `index`.
    pub fn index(self, index: usize) -> Self {
        self.then(Step::Index(index))
    }

    /// The member at `position` of an object.
    pub fn member(self, position: usize) -> Self {
        self.then(Step::Member(position))
    }

    /// The name of the member at `position` of an object: read only.
    pub fn name(self, position: usize) -> Self {
        self.then(Step::Name(position)).read_only()
    }

    /// The same place, and every place under it, read only: the verifier
    /// reads the string there, and the client gets it as the provider sent
    /// it (a member's name; a token of logprobs, which follow the text they
    /// spell and move when it is edited).
    pub fn read_only(mut self) -> Self {
        self.read_only = true;
        self
    }

    /// Member `name` of `object` (the value this location points at): its
    /// location, by position, and its value; `None` when there is none.
    pub fn named<'a>(self, object: &'a Value, name: &str) -> Option<(Self, &'a Value)> {
        object
            .as_object()?
            .iter()
            .enumerate()
            .find(|(_, (key, _))| key.as_str() == name)
            .map(|(position, (_, value))| (self.member(position), value))
    }

    /// Whether it ends in a member's name ([`Location::name`]).
    fn is_name(&self) -> bool {
        self.len != Self::NOWHERE
            && self.len > 0
            && self.steps[usize::from(self.len) - 1].0 >> PackedStep::KIND_SHIFT == PackedStep::NAME
    }

    /// Whether the string there is read only ([`Location::read_only`]).
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// Whether one more step fits.
    pub fn has_room(&self) -> bool {
        usize::from(self.len) < MAX_STEPS
    }

    /// The steps, unpacked; none for a location that points at nothing
    /// (which [`Location::get`] tells apart).
    fn steps(&self) -> impl Iterator<Item = Step> + '_ {
        let len = if self.len == Self::NOWHERE {
            0
        } else {
            usize::from(self.len)
        };
        self.steps[..len].iter().map(|packed| packed.unpack())
    }

    /// The value there, if any (none where a member's name is: a name is
    /// not a value).
    pub fn get<'a>(&self, mut value: &'a Value) -> Option<&'a Value> {
        if self.len == Self::NOWHERE {
            return None;
        }
        for step in self.steps() {
            value = match step {
                Step::Key(key) => value.get(key.name())?,
                Step::Index(index) => value.get(index)?,
                Step::Member(position) => value.as_object()?.values().nth(position)?,
                Step::Name(_) => return None,
            };
        }
        Some(value)
    }

    /// The string there, if any: a string value, or a member's name.
    pub fn text<'a>(&self, value: &'a Value) -> Option<&'a str> {
        if !self.is_name() {
            return self.get(value)?.as_str();
        }
        let mut parent = *self;
        parent.len -= 1;
        let Step::Name(position) = self.steps[usize::from(parent.len)].unpack() else {
            return None;
        };
        let members = parent.get(value)?.as_object()?;
        members.keys().nth(position).map(String::as_str)
    }

    /// The value there, to replace, if any (none where a member's name is:
    /// a name is not replaced).
    pub fn get_mut<'a>(&self, mut value: &'a mut Value) -> Option<&'a mut Value> {
        if self.len == Self::NOWHERE {
            return None;
        }
        for step in self.steps() {
            value = match step {
                Step::Key(key) => value.get_mut(key.name())?,
                Step::Index(index) => value.get_mut(index)?,
                Step::Member(position) => value.as_object_mut()?.values_mut().nth(position)?,
                Step::Name(_) => return None,
            };
        }
        Some(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_location_is_small_and_finds_its_value() {
        // Every stream event moves its Locations by value: packed steps keep
        // one at 68 bytes (16-byte steps made twelve of them 200).
        assert_eq!(std::mem::size_of::<Location>(), 68);
        let value = serde_json::json!({"choices": [{"delta": {"content": "hi", "x": "y"}}]});
        let at = Location::ROOT.key(Key::Choices).index(0).key(Key::Delta);
        assert_eq!(
            at.key(Key::Content).get(&value),
            Some(&value["choices"][0]["delta"]["content"])
        );
        assert_eq!(at.member(1).get(&value), Some(&serde_json::json!("y")));
        assert_eq!(at.key(Key::Refusal).get(&value), None);
        let mut edited = value.clone();
        *at.key(Key::Content).get_mut(&mut edited).unwrap() = serde_json::json!("yo");
        assert_eq!(edited["choices"][0]["delta"]["content"], "yo");
    }

    #[test]
    fn a_name_step_reads_a_members_name_and_never_replaces_it() {
        let mut value = serde_json::json!({"choices": [{"delta": {"content": "hi", "x_CG1": 1}}]});
        let delta = Location::ROOT.key(Key::Choices).index(0).key(Key::Delta);
        assert_eq!(delta.name(1).text(&value), Some("x_CG1"));
        assert_eq!(delta.name(0).text(&value), Some("content"));
        assert_eq!(delta.name(2).text(&value), None);
        assert_eq!(delta.key(Key::Content).text(&value), Some("hi"));
        assert_eq!(delta.member(1).text(&value), None, "a number is no text");
        assert_eq!(delta.name(1).get(&value), None, "a name is not a value");
        assert!(delta.name(1).get_mut(&mut value).is_none());
    }

    #[test]
    fn every_key_packs_and_unpacks_to_itself() {
        for key in Key::ALL {
            let at = Location::ROOT.key(key);
            assert_eq!(at.steps().collect::<Vec<_>>(), [Step::Key(key)]);
        }
        let names: std::collections::HashSet<_> = Key::ALL.iter().map(|key| key.name()).collect();
        assert_eq!(names.len(), Key::ALL.len(), "one name per key");
    }

    #[test]
    fn positions_pack_up_to_their_limit_and_past_it_point_at_nothing() {
        let at = Location::ROOT.key(Key::Choices);
        let last = PackedStep::MAX_POSITION;
        assert_eq!(
            at.index(last).member(last).steps().collect::<Vec<_>>(),
            [
                Step::Key(Key::Choices),
                Step::Index(last),
                Step::Member(last)
            ]
        );
        let nowhere = at.index(last + 1);
        let value = serde_json::json!({"choices": ["a"]});
        assert_eq!(nowhere.get(&value), None);
        assert!(!nowhere.has_room());
        // Further steps keep it nowhere, whatever they are.
        assert_eq!(nowhere.index(0).get(&value), None);
        assert_eq!(at.index(0).get(&value), Some(&serde_json::json!("a")));
    }

    #[test]
    fn a_location_holds_sixteen_steps() {
        let mut value = serde_json::json!("deep");
        for _ in 0..MAX_STEPS {
            value = serde_json::json!([value]);
        }
        let mut at = Location::ROOT;
        while at.has_room() {
            at = at.index(0);
        }
        assert_eq!(at.get(&value), Some(&serde_json::json!("deep")));
    }
}
