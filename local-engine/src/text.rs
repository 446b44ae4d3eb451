//! Tokenizer and chat template of a model directory.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use chrono::format::{Item, StrftimeItems};
use regex::Regex;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokenizers::Tokenizer;

use crate::EngineError;

/// One OpenAI-style chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// Message text.
    pub content: String,
}

/// Renders chat messages into a prompt string, byte for byte as Hugging Face transformers'
/// `apply_chat_template(messages, add_generation_prompt=True)` renders them, so a model gets the
/// prompt it was trained on ([`ChatTemplate::render_continuing`]: as
/// `continue_final_message=True` does).
///
/// The template is `chat_template.jinja` in the model directory, else `chat_template` from
/// `tokenizer_config.json` (a string, or a list of named templates of which `default` is taken).
/// It is rendered in transformers' jinja2 environment (`trim_blocks`, `lstrip_blocks`, loop
/// controls; `raise_exception`, `strftime_now`, a `tojson` that writes what Python's `json.dumps`
/// writes, Python's string and dict methods, the `{% generation %}` block) with `messages`,
/// `add_generation_prompt = true`, `tools` and `documents` none, and every special token the model
/// sets (`bos_token`, `eos_token`, `unk_token`, `sep_token`, `pad_token`, `cls_token`,
/// `mask_token`), from `special_tokens_map.json` over `tokenizer_config.json`. Without a
/// template, the documented fallback renders each message as `<|role|>\n{content}\n` and ends
/// with `<|assistant|>\n`.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    /// The compiled template, under [`TEMPLATE_NAME`]; `None` for the fallback.
    environment: Option<Arc<minijinja::Environment<'static>>>,
    /// The template's source, as the model directory holds it.
    source: Option<Arc<str>>,
    /// The special tokens the model sets, by name.
    special_tokens: BTreeMap<String, minijinja::Value>,
}

/// The name the template is compiled under.
const TEMPLATE_NAME: &str = "chat_template";

/// Marks the end of the message a prompt continues ([`ChatTemplate::render_continuing`]): a
/// private-use character, which templates' string methods (`trim`, `strip`) keep, taken out of
/// messages' own text before rendering.
pub(crate) const END_OF_PREFILL: char = '\u{F8F2}';

/// The special tokens transformers passes to a template by name, when the model sets them.
const SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// A token's text: a string, or an `AddedToken` object's `content`.
fn token_text(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_owned),
        _ => None,
    }
}

/// The special tokens `config` sets (a `tokenizer_config.json` or `special_tokens_map.json`).
fn special_tokens_of(config: &Value) -> BTreeMap<String, minijinja::Value> {
    let mut tokens = BTreeMap::new();
    for name in SPECIAL_TOKENS {
        if let Some(text) = config.get(name).and_then(token_text) {
            tokens.insert(name.to_owned(), minijinja::Value::from(text));
        }
    }
    tokens
}

fn read_json(path: &Path) -> Result<Option<Value>, EngineError> {
    if !path.exists() {
        return Ok(None);
    }
    let err = |e: String| EngineError::Template(format!("{}: {e}", path.display()));
    let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| err(e.to_string()))
}

/// The template `tokenizer_config.json` (`config`) holds: a string, or the `default` of a list
/// of named templates.
fn config_template(config: &Value) -> Result<Option<String>, String> {
    match config.get("chat_template") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(named)) => Ok(named
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(str::to_string)),
        Some(other) => Err(format!("chat_template must be a string, got {other}")),
    }
}

impl ChatTemplate {
    /// The fallback template only.
    pub fn fallback() -> Self {
        Self {
            environment: None,
            source: None,
            special_tokens: BTreeMap::new(),
        }
    }

    /// Reads the template and special tokens of the model directory `dir`; the template is
    /// compiled once here so a broken one fails at start, not on the first request.
    pub fn load(dir: &Path) -> Result<Self, EngineError> {
        let config_path = dir.join("tokenizer_config.json");
        let config = read_json(&config_path)?.unwrap_or(Value::Null);
        let err =
            |path: &Path, e: String| EngineError::Template(format!("{}: {e}", path.display()));
        let file_path = dir.join("chat_template.jinja");
        let (source, source_path) = if file_path.exists() {
            let source =
                std::fs::read_to_string(&file_path).map_err(|e| err(&file_path, e.to_string()))?;
            (Some(source), file_path)
        } else {
            let source = config_template(&config).map_err(|e| err(&config_path, e))?;
            (source, config_path)
        };
        // `special_tokens_map.json`, when there is one, wins, as in transformers.
        let mut special_tokens = special_tokens_of(&config);
        if let Some(map) = read_json(&dir.join("special_tokens_map.json"))? {
            special_tokens.extend(special_tokens_of(&map));
        }
        let environment = match &source {
            Some(source) => {
                let mut env = environment();
                env.add_template_owned(TEMPLATE_NAME, with_generation_blocks_opened(source))
                    .map_err(|e| err(&source_path, e.to_string()))?;
                Some(Arc::new(env))
            }
            None => None,
        };
        Ok(Self {
            environment,
            source: source.map(Arc::from),
            special_tokens,
        })
    }

    /// The template's source; `None` for the fallback.
    pub fn source(&self) -> Option<&str> {
        self.source.as_deref()
    }

    /// Renders `messages` into a prompt that ends where the assistant's reply begins.
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String, EngineError> {
        self.render_with(messages, true)
    }

    /// Renders `messages`, the last of which is the start of the assistant's reply, into a
    /// prompt that ends where that start does, for the model to continue it (transformers'
    /// `continue_final_message`): rendered without the generation prompt, with a private-use
    /// mark after the last message's text, and cut there (a search for the text
    /// itself could match an earlier message, or the template's own markup after a short one).
    /// An error when the template does not show the end of that text.
    pub fn render_continuing(&self, messages: &[ChatMessage]) -> Result<String, EngineError> {
        let mut marked = messages.to_vec();
        if let Some(last) = marked.last_mut() {
            last.content.push(END_OF_PREFILL);
        }
        let mut prompt = self.render_with(&marked, false)?;
        let end = prompt.rfind(END_OF_PREFILL).ok_or_else(|| {
            EngineError::Template(
                "the template does not show the end of the last message, so it cannot be \
                 continued"
                    .into(),
            )
        })?;
        prompt.truncate(end);
        Ok(prompt)
    }

    fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, EngineError> {
        let Some(environment) = &self.environment else {
            let mut prompt = String::new();
            for m in messages {
                prompt.push_str(&format!("<|{}|>\n{}\n", m.role, m.content));
            }
            if add_generation_prompt {
                prompt.push_str("<|assistant|>\n");
            }
            return Ok(prompt);
        };
        let template = environment
            .get_template(TEMPLATE_NAME)
            .map_err(|e| EngineError::Template(e.to_string()))?;
        let mut context = self.special_tokens.clone();
        context.insert(
            "messages".into(),
            minijinja::Value::from_serialize(messages),
        );
        context.insert(
            "add_generation_prompt".into(),
            minijinja::Value::from(add_generation_prompt),
        );
        context.insert("tools".into(), minijinja::Value::from(()));
        context.insert("documents".into(), minijinja::Value::from(()));
        template
            .render(context)
            .map_err(|e| EngineError::Template(e.to_string()))
    }
}

/// transformers' jinja2 environment for chat templates, in minijinja.
fn environment() -> minijinja::Environment<'static> {
    let mut env = minijinja::Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |message: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                message,
            ))
        },
    );
    // jinja2's `iterable` is false for none (a template's `tools is iterable`); minijinja's is
    // true.
    env.add_test("iterable", |value: &minijinja::Value| {
        !value.is_none() && value.try_iter().is_ok()
    });
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    env
}

/// `strftime_now(format)`: the local time now, in Python's strftime codes.
fn strftime_now(format: String) -> Result<String, minijinja::Error> {
    let items: Vec<Item<'_>> = StrftimeItems::new(&format).collect();
    if items.iter().any(|item| matches!(item, Item::Error)) {
        return Err(minijinja::Error::new(
            minijinja::ErrorKind::InvalidOperation,
            format!("strftime_now: unsupported format {format:?}"),
        ));
    }
    Ok(chrono::Local::now()
        .format_with_items(items.into_iter())
        .to_string())
}

/// `tojson`, as transformers defines it: Python's `json.dumps(value, ensure_ascii=False)`,
/// with its `indent` and `sort_keys`: `", "` and `": "` between items, or one item a line
/// when indented; nothing escaped for HTML.
fn tojson(
    value: &minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> Result<minijinja::Value, minijinja::Error> {
    let invalid = |e: String| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e);
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut json = serde_json::to_value(value).map_err(|e| invalid(e.to_string()))?;
    if sort_keys == Some(true) {
        json.sort_all_objects();
    }
    let mut out = Vec::new();
    let written = match indent {
        Some(width) => {
            let spaces = " ".repeat(width);
            let formatter = serde_json::ser::PrettyFormatter::with_indent(spaces.as_bytes());
            json.serialize(&mut serde_json::Serializer::with_formatter(
                &mut out, formatter,
            ))
        }
        None => json.serialize(&mut serde_json::Serializer::with_formatter(
            &mut out,
            PythonJsonFormatter,
        )),
    };
    written.map_err(|e| invalid(e.to_string()))?;
    let text = String::from_utf8(out).map_err(|e| invalid(e.to_string()))?;
    Ok(minijinja::Value::from_safe_string(text))
}

/// Python's default JSON separators: `", "` between items, `": "` after a key.
struct PythonJsonFormatter;

impl serde_json::ser::Formatter for PythonJsonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.begin_array_value(writer, first)
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

/// `source` with transformers' `{% generation %}` ... `{% endgeneration %}` block (which marks
/// the assistant's tokens and otherwise renders its body) written as an `if true` block, which
/// renders its body the same, whitespace control included.
fn with_generation_blocks_opened(source: &str) -> String {
    static GENERATION: OnceLock<Regex> = OnceLock::new();
    let pattern = GENERATION.get_or_init(|| {
        Regex::new(r"(\{%[-+]?\s*)(end)?generation(\s*[-+]?%\})").expect("a valid pattern")
    });
    pattern
        .replace_all(source, |captures: &regex::Captures<'_>| {
            let tag = if captures.get(2).is_some() {
                "endif"
            } else {
                "if true"
            };
            format!("{}{tag}{}", &captures[1], &captures[3])
        })
        .into_owned()
}

/// Loads `tokenizer.json` from a model directory.
pub fn load_tokenizer(dir: &Path) -> Result<Tokenizer, EngineError> {
    let path = dir.join("tokenizer.json");
    Tokenizer::from_file(&path)
        .map_err(|e| EngineError::Tokenizer(format!("{}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn messages() -> Vec<ChatMessage> {
        vec![
            ChatMessage {
                role: "system".into(),
                content: "Be brief.".into(),
            },
            ChatMessage {
                role: "user".into(),
                content: "Hi".into(),
            },
        ]
    }

    #[test]
    fn template_from_tokenizer_config() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"bos_token": {"content": "<s>"}, "eos_token": "</s>",
            "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"}"#,
        )
        .unwrap();
        let t = ChatTemplate::load(dir.path()).unwrap();
        assert_eq!(
            t.render(&messages()).unwrap(),
            "<s>[system]Be brief.</s>[user]Hi</s>[assistant]"
        );
    }

    #[test]
    fn a_prefill_is_continued_where_it_ends() {
        let dir = tempfile::tempdir().unwrap();
        // ChatML-like, its contents trimmed, as many templates do.
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"}"#,
        )
        .unwrap();
        let t = ChatTemplate::load(dir.path()).unwrap();
        let chat = |prefill: &str| {
            vec![
                ChatMessage {
                    role: "user".into(),
                    content: "Show it as JSON:\n{\"a\": 1}".into(),
                },
                ChatMessage {
                    role: "assistant".into(),
                    content: prefill.into(),
                },
            ]
        };
        let opened =
            "<|im_start|>user\nShow it as JSON:\n{\"a\": 1}<|im_end|>\n<|im_start|>assistant\n";
        // A prefill the template trims, whose text also appears earlier; a
        // short one that also appears in the template's markup.
        assert_eq!(
            t.render_continuing(&chat("\n{")).unwrap(),
            format!("{opened}{{")
        );
        assert_eq!(
            t.render_continuing(&chat("<")).unwrap(),
            format!("{opened}<")
        );
    }

    #[test]
    fn fallback_without_config_and_template_errors() {
        let dir = tempfile::tempdir().unwrap();
        let t = ChatTemplate::load(dir.path()).unwrap();
        assert_eq!(
            t.render(&messages()).unwrap(),
            "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
        );
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"chat_template": "{{ raise_exception('no system role') }}"}"#,
        )
        .unwrap();
        let err = ChatTemplate::load(dir.path())
            .unwrap()
            .render(&messages())
            .unwrap_err();
        assert!(err.to_string().contains("no system role"), "{err}");
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"chat_template": "{% if %}"}"#,
        )
        .unwrap();
        assert!(ChatTemplate::load(dir.path()).is_err());
    }
}
