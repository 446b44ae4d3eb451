//! Tokenizer and chat template of a model directory.

use std::path::Path;

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

/// Renders chat messages into a prompt string.
///
/// Uses `chat_template` from `tokenizer_config.json` (a string, or a list of named templates of
/// which `default` is taken) with `messages`, `bos_token`, `eos_token` and
/// `add_generation_prompt = true`. Without one, the documented fallback renders each message as
/// `<|role|>\n{content}\n` and ends with `<|assistant|>\n`.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    source: Option<String>,
    bos_token: String,
    eos_token: String,
}

fn token_text(value: Option<&Value>) -> String {
    match value {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string(),
        _ => String::new(),
    }
}

impl ChatTemplate {
    /// The fallback template only.
    pub fn fallback() -> Self {
        Self {
            source: None,
            bos_token: String::new(),
            eos_token: String::new(),
        }
    }

    /// Reads `tokenizer_config.json` in `dir` if present; the template is compiled once here so
    /// a broken one fails at start, not on the first request.
    pub fn load(dir: &Path) -> Result<Self, EngineError> {
        let path = dir.join("tokenizer_config.json");
        if !path.exists() {
            return Ok(Self::fallback());
        }
        let err = |e: String| EngineError::Template(format!("{}: {e}", path.display()));
        let text = std::fs::read_to_string(&path).map_err(|e| err(e.to_string()))?;
        let json: Value = serde_json::from_str(&text).map_err(|e| err(e.to_string()))?;
        let source = match json.get("chat_template") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Array(named)) => named
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(Value::as_str)
                .map(str::to_string),
            Some(other) => return Err(err(format!("chat_template must be a string, got {other}"))),
        };
        let template = Self {
            source,
            bos_token: token_text(json.get("bos_token")),
            eos_token: token_text(json.get("eos_token")),
        };
        if let Some(source) = &template.source {
            environment()
                .template_from_str(source)
                .map_err(|e| err(e.to_string()))?;
        }
        Ok(template)
    }

    /// Renders `messages` into a prompt that ends where the assistant's reply begins.
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String, EngineError> {
        let Some(source) = &self.source else {
            let mut prompt = String::new();
            for m in messages {
                prompt.push_str(&format!("<|{}|>\n{}\n", m.role, m.content));
            }
            prompt.push_str("<|assistant|>\n");
            return Ok(prompt);
        };
        let env = environment();
        let template = env
            .template_from_str(source)
            .map_err(|e| EngineError::Template(e.to_string()))?;
        template
            .render(minijinja::context! {
                messages => messages,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
                add_generation_prompt => true,
            })
            .map_err(|e| EngineError::Template(e.to_string()))
    }
}

fn environment() -> minijinja::Environment<'static> {
    let mut env = minijinja::Environment::new();
    env.add_function(
        "raise_exception",
        |message: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                message,
            ))
        },
    );
    env
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
