//! JSON strings read from an event's data without copying them: the light
//! readings' text ([`Chunk::light`](super::format::Chunk::light)).

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;
use std::ops::Range;

use serde::Deserialize;
use serde::de::{Deserializer, Error, Visitor};

use super::format::LightText;

/// A JSON string, borrowed from the data when it holds no escape. serde
/// borrows a `Cow<str>` only as a member's own type, never inside an
/// `Option`: this type borrows wherever it is.
pub struct JsonStr<'a>(pub Cow<'a, str>);

impl JsonStr<'_> {
    /// The string as `data`, the JSON it was read from, holds it: its
    /// bytes' place there when it held no escape, else the string itself.
    pub fn in_data(self, data: &str) -> LightText {
        match self.0 {
            Cow::Borrowed(text) => range_in(data, text)
                .map_or_else(|| LightText::Unescaped(text.into()), LightText::InData),
            Cow::Owned(text) => LightText::Unescaped(text),
        }
    }
}

impl PartialEq<str> for JsonStr<'_> {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for JsonStr<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        /// Takes the string where the parser has it.
        struct StrVisitor<'a>(PhantomData<JsonStr<'a>>);

        impl<'de: 'a, 'a> Visitor<'de> for StrVisitor<'a> {
            type Value = JsonStr<'a>;

            fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
                formatter.write_str("a string")
            }

            fn visit_borrowed_str<E: Error>(self, text: &'de str) -> Result<Self::Value, E> {
                Ok(JsonStr(Cow::Borrowed(text)))
            }

            fn visit_str<E: Error>(self, text: &str) -> Result<Self::Value, E> {
                Ok(JsonStr(Cow::Owned(text.to_owned())))
            }

            fn visit_string<E: Error>(self, text: String) -> Result<Self::Value, E> {
                Ok(JsonStr(Cow::Owned(text)))
            }
        }

        deserializer.deserialize_str(StrVisitor(PhantomData))
    }
}

/// Where `part` sits in `whole`, when it is a slice of it.
pub(super) fn range_in(whole: &str, part: &str) -> Option<Range<usize>> {
    let start = (part.as_ptr() as usize).checked_sub(whole.as_ptr() as usize)?;
    let end = start.checked_add(part.len())?;
    (end <= whole.len()).then_some(start..end)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(data: &str) -> LightText {
        let text: JsonStr<'_> = serde_json::from_str(data).unwrap();
        text.in_data(data)
    }

    #[test]
    fn a_string_without_escapes_is_read_where_it_is() {
        let data = r#""Hello there""#;
        assert!(
            matches!(read(data), LightText::InData(range) if &data[range.clone()] == "Hello there")
        );
        assert!(matches!(read(r#""""#), LightText::InData(range) if range == (1..1)));
    }

    #[test]
    fn a_string_with_escapes_is_unescaped() {
        for (data, text) in [
            (r#""say \"hi\"""#, "say \"hi\""),
            (r#""line\nbreak""#, "line\nbreak"),
            (r#""\u00e9t\u00e9""#, "été"),
        ] {
            assert!(
                matches!(read(data), LightText::Unescaped(read) if read == text),
                "{data}"
            );
        }
    }

    #[test]
    fn a_slice_of_other_memory_has_no_range() {
        let data = String::from("abc");
        let other = String::from("abc");
        assert_eq!(range_in(&data, &data[1..]), Some(1..3));
        assert_eq!(range_in(&data, &other), None);
    }
}
