//! Function calling: which functions the model calls, and with what
//! arguments.
//!
//! The model calls a function when `tool_choice` (or legacy `function_call`)
//! names it, when it is `"required"` (the functions the last user message
//! names, else the first one offered), or, under `"auto"`, when the last user
//! message names it. With `parallel_tool_calls` (the default) it calls every
//! function named there; otherwise only the first.
//!
//! Arguments are a JSON object built from the function's
//! `parameters.properties`: the first string property quotes the last user
//! message as the model saw it, canary blocks included (a real model copying
//! its prompt into a call would do the same, so a canary it saw can end up in
//! the arguments); further strings take the client's words in turn; integers
//! and numbers the word count; booleans `true`; enums their first value;
//! arrays one item; objects recurse.

use serde_json::{Map, Value, json};

use crate::request::{CallChoice, FunctionSpec, Tooling};

/// Deepest nesting of `object` properties filled in.
const MAX_DEPTH: usize = 4;

/// The functions called, in order, for a last user message `user_text` (as
/// the model saw it) whose client part is `subject`.
pub fn calls<'a>(tooling: &'a Tooling, user_text: &str) -> Vec<&'a FunctionSpec> {
    let named: Vec<&FunctionSpec> = tooling
        .functions
        .iter()
        .filter(|spec| mentions(user_text, &spec.name))
        .collect();
    let mut chosen = match &tooling.choice {
        CallChoice::Never => Vec::new(),
        CallChoice::Named(name) => tooling
            .functions
            .iter()
            .filter(|spec| &spec.name == name)
            .take(1)
            .collect(),
        CallChoice::Required if named.is_empty() => tooling.functions.iter().take(1).collect(),
        CallChoice::Required | CallChoice::Auto => named,
    };
    if !tooling.parallel {
        chosen.truncate(1);
    }
    chosen
}

/// Whether `text` names `name` as a whole word (`get_weather`, not
/// `get_weather_history`).
fn mentions(text: &str, name: &str) -> bool {
    let is_word = |c: char| c.is_alphanumeric() || c == '_' || c == '-';
    text.match_indices(name).any(|(start, _)| {
        let before = text[..start].chars().next_back();
        let after = text[start + name.len()..].chars().next();
        !before.is_some_and(is_word) && !after.is_some_and(is_word)
    })
}

/// The arguments of a call to `spec`, as the JSON text a provider sends.
pub fn arguments(spec: &FunctionSpec, user_text: &str, subject: &str) -> String {
    let mut strings = Strings {
        quote: Some(user_text.split_whitespace().collect::<Vec<_>>().join(" ")),
        words: subject.split_whitespace().map(str::to_owned).collect(),
        next: 0,
    };
    let count = strings.words.len() as u64;
    let value = object(&spec.parameters, &mut strings, count, 0);
    value.to_string()
}

/// Where string values come from, in turn.
struct Strings {
    /// The whole last user message, for the first string.
    quote: Option<String>,
    words: Vec<String>,
    next: usize,
}

impl Strings {
    fn take(&mut self) -> String {
        if let Some(quote) = self.quote.take() {
            return quote;
        }
        let word = self
            .words
            .get(self.next % self.words.len().max(1))
            .cloned()
            .unwrap_or_else(|| "nothing".to_owned());
        self.next += 1;
        word
    }
}

fn object(schema: &Value, strings: &mut Strings, count: u64, depth: usize) -> Value {
    let mut fields = Map::new();
    if let Some(properties) = schema["properties"].as_object()
        && depth < MAX_DEPTH
    {
        for (name, property) in properties {
            fields.insert(name.clone(), value(property, strings, count, depth + 1));
        }
    }
    Value::Object(fields)
}

fn value(schema: &Value, strings: &mut Strings, count: u64, depth: usize) -> Value {
    if let Some(first) = schema["enum"].as_array().and_then(|values| values.first()) {
        return first.clone();
    }
    let kind = match &schema["type"] {
        Value::Array(kinds) => kinds.iter().find(|kind| *kind != "null").cloned(),
        kind => Some(kind.clone()),
    };
    match kind.as_ref().and_then(Value::as_str) {
        Some("integer") => json!(count),
        Some("number") => json!(count as f64 + 0.5),
        Some("boolean") => json!(true),
        Some("null") => Value::Null,
        Some("array") => json!([value(&schema["items"], strings, count, depth + 1)]),
        Some("object") => object(schema, strings, count, depth),
        _ => json!(strings.take()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, parameters: Value) -> FunctionSpec {
        FunctionSpec {
            name: name.into(),
            parameters,
        }
    }

    fn tooling(choice: CallChoice, parallel: bool) -> Tooling {
        Tooling {
            functions: vec![
                spec("get_weather", Value::Null),
                spec("get_tides", Value::Null),
            ],
            choice,
            legacy: false,
            parallel,
        }
    }

    fn names(specs: Vec<&FunctionSpec>) -> Vec<&str> {
        specs.into_iter().map(|spec| spec.name.as_str()).collect()
    }

    #[test]
    fn the_choice_decides_which_functions_are_called() {
        let both = "use get_tides and get_weather";
        let auto = tooling(CallChoice::Auto, true);
        assert_eq!(names(calls(&auto, both)), ["get_weather", "get_tides"]);
        assert!(calls(&auto, "nothing named; get_weather_history").is_empty());
        let serial = tooling(CallChoice::Auto, false);
        assert_eq!(names(calls(&serial, both)), ["get_weather"]);
        let required = tooling(CallChoice::Required, true);
        assert_eq!(names(calls(&required, "hello")), ["get_weather"]);
        let named = tooling(CallChoice::Named("get_tides".into()), true);
        assert_eq!(names(calls(&named, both)), ["get_tides"]);
        assert!(calls(&tooling(CallChoice::Never, true), both).is_empty());
    }

    #[test]
    fn arguments_follow_the_schema_and_quote_the_user() {
        let parameters = json!({"type": "object", "properties": {
            "query": {"type": "string"},
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer"},
            "detailed": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "where": {"type": "object", "properties": {"lat": {"type": ["number", "null"]}}},
        }});
        let user = "Weather  in Oslo\n\n[CG-X]";
        let text = arguments(&spec("f", parameters), user, "Weather in Oslo");
        let parsed: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            parsed,
            json!({"query": "Weather in Oslo [CG-X]", "city": "Weather", "unit": "celsius",
                   "days": 3, "detailed": true, "tags": ["in"], "where": {"lat": 3.5}}),
            "properties in the schema's order"
        );
        assert_eq!(arguments(&spec("f", Value::Null), user, ""), "{}");
    }
}
