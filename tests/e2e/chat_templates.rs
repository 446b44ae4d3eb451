//! The local engine renders a model's chat template as Hugging Face
//! transformers renders it, byte for byte: each case is a model directory
//! whose template (written here, each leaning on one thing published
//! templates use) is rendered by the engine's `ChatTemplate` and by
//! transformers' own `apply_chat_template` (tests/python/chat_templates.py),
//! and the two prompts must be equal, or both renders must fail with the
//! template's message.
//!
//! What the cases lean on: jinja2's `trim_blocks` and `lstrip_blocks`,
//! Python's string and dict methods, `strftime_now`, `tools` and
//! `documents` given as none, transformers' `tojson` (Python's separators,
//! nothing escaped, `indent`, `sort_keys`, keys in the order written), the
//! `{% generation %}` block, every special token the model sets,
//! `chat_template.jinja` over the config's template, `namespace` and loop
//! controls, and `raise_exception`.

use std::path::{Path, PathBuf};
use std::process::Command;

use canarygate_engine::{ChatMessage, ChatTemplate};
use serde_json::{Value, json};

use crate::common::*;

/// A word-level tokenizer: the prompt is rendered as text, so any tokenizer
/// transformers can load will do.
const TOKENIZER_JSON: &str = r#"{"version": "1.0", "truncation": null, "padding": null,
  "added_tokens": [], "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
  "post_processor": null, "decoder": null,
  "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1}, "unk_token": "[UNK]"}}"#;

/// Block tags on lines of their own, indented: the prompt is right only
/// with `trim_blocks` and `lstrip_blocks`.
const WHITESPACE: &str = "{{ bos_token }}
{% for message in messages %}
    {% if message.role == 'system' %}
<<SYS>>{{ message.content }}<</SYS>>
    {% else %}
[{{ message.role }}] {{ message.content }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
[assistant]
{% endif %}";

/// Python's string and dict methods.
const PYTHON_METHODS: &str = "{% for m in messages %}
{% set text = m.content.strip() %}
{% if text.startswith('/') %}
CMD:{{ text[1:].split(' ')[0] }}|{{ text.split(' ', 1)[1].title() }}
{% else %}
{{ m.role.upper() }}:{{ text.replace('\n', ' ').lstrip('-') }}{{ '' if text.endswith('?') else '.' }}
{% endif %}
{% endfor %}
{% set opts = {'sep': '|', 'tail': '>'} %}
{% for key, value in opts.items() %}{{ key }}={{ value }};{% endfor %}
{{ opts.get('missing', 'default') }}{{ opts.get('tail') }}";

/// The date, as Llama-style templates ask for it.
const DATE: &str =
    "{% if strftime_now is defined %}{{ strftime_now('%Y') }}{% else %}no clock{% endif %}
|{{ messages[-1].content }}";

/// What a template without tools sees.
const NO_TOOLS: &str =
    "{% if tools is iterable and tools | length > 0 %}tools{% else %}no tools{% endif %}
|{{ tools is none }}|{{ documents is none }}|{{ tools is defined }}|{{ messages | length }}";

/// transformers' `tojson`.
const TOJSON: &str = "{{ messages[1:3] | tojson }}
{{ {'name': 'lookup', 'args': [1, 2.5, 'é', '<b>&</b>', none, true]} | tojson }}
{{ {'b': 1, 'a': {'d': 2, 'c': 3}} | tojson(sort_keys=true) }}
{{ messages[0] | tojson(indent=2) }}";

/// The assistant's turns in `{% generation %}` blocks, with and without
/// whitespace control.
const GENERATION: &str = "{% for m in messages %}
{% if m.role == 'assistant' %}
<a>{% generation %}{{ m.content }}{% endgeneration %}</a>
{% else %}
<{{ m.role }}>
{%- generation -%}
  {{ m.content }}
{%- endgeneration %}
{% endif %}
{% endfor %}";

/// Every special token the model sets.
const SPECIAL_TOKENS: &str = "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}|\
{{ additional_special_tokens | join(',') }}|{{ sep_token is defined }}|{{ messages[0].role }}";

/// `namespace` and loop controls: the turns up to the last user message,
/// the system message skipped.
const NAMESPACE: &str = "{% set ns = namespace(last_user=0) %}
{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{% for m in messages %}
{% if loop.index0 > ns.last_user %}{% break %}{% endif %}
{% if m.role == 'system' %}{% continue %}{% endif %}
{{ loop.index }}:{{ m.content | trim }};
{% endfor %}";

/// A template that refuses a system message.
const NO_SYSTEM: &str = "{% if messages[0].role == 'system' %}\
{{ raise_exception('System role not supported') }}{% endif %}\
{% for m in messages %}{{ m.content }}{% endfor %}";

fn message(role: &str, content: &str) -> ChatMessage {
    ChatMessage {
        role: role.into(),
        content: content.into(),
    }
}

/// A conversation with what templates trip on: a system message, padding
/// and line breaks, a command, markup, quotes and non-ASCII text.
fn conversation() -> Vec<ChatMessage> {
    vec![
        message("system", "You are terse."),
        message("user", "  \n-What is the capital\nof France?  \n"),
        message("assistant", "Paris."),
        message("user", "/search rivers of europe"),
        message(
            "assistant",
            "The <b>Rhine</b> & the \"Danube\" — it's 'long'.",
        ),
        message("user", "Merci, et le Rhône ? {{ not a tag }}"),
    ]
}

/// Writes a model directory `name` under `root` with `config` as its
/// `tokenizer_config.json`, and `files` beside it.
fn model_dir(root: &Path, name: &str, config: Value, files: &[(&str, &str)]) -> PathBuf {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let mut config = config;
    config["tokenizer_class"] = json!("PreTrainedTokenizerFast");
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    std::fs::write(dir.join("tokenizer.json"), TOKENIZER_JSON).unwrap();
    for (file, text) in files {
        std::fs::write(dir.join(file), text).unwrap();
    }
    dir
}

#[test]
fn chat_templates_render_as_transformers_renders_them() {
    let root = tempfile::tempdir().unwrap();
    let plain = |template: &str| json!({"bos_token": "<s>", "eos_token": "</s>", "chat_template": template});
    let without_system: Vec<ChatMessage> = conversation().into_iter().skip(1).collect();
    let cases: Vec<(&str, PathBuf, Vec<ChatMessage>)> = vec![
        (
            "whitespace",
            model_dir(root.path(), "whitespace", plain(WHITESPACE), &[]),
            conversation(),
        ),
        (
            "python_methods",
            model_dir(root.path(), "python_methods", plain(PYTHON_METHODS), &[]),
            conversation(),
        ),
        (
            "date",
            model_dir(root.path(), "date", plain(DATE), &[]),
            conversation(),
        ),
        (
            "no_tools",
            model_dir(root.path(), "no_tools", plain(NO_TOOLS), &[]),
            conversation(),
        ),
        (
            "tojson",
            model_dir(root.path(), "tojson", plain(TOJSON), &[]),
            conversation(),
        ),
        (
            "generation",
            model_dir(root.path(), "generation", plain(GENERATION), &[]),
            conversation(),
        ),
        (
            "special_tokens",
            model_dir(
                root.path(),
                "special_tokens",
                json!({"bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": false, "normalized": false,
                                     "rstrip": false, "single_word": false, "special": true},
                       "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
                       "additional_special_tokens": ["<tool>", "</tool>"],
                       "chat_template": SPECIAL_TOKENS}),
                &[],
            ),
            conversation(),
        ),
        (
            "named_default",
            model_dir(
                root.path(),
                "named_default",
                json!({"bos_token": "<s>", "eos_token": "</s>", "chat_template": [
                    {"name": "tool_use", "template": "TOOLS"},
                    {"name": "default", "template": NAMESPACE}]}),
                &[],
            ),
            conversation(),
        ),
        (
            "special_tokens_map",
            model_dir(
                root.path(),
                "special_tokens_map",
                plain("{{ bos_token }}|{{ pad_token }}|{{ unk_token }}"),
                &[(
                    "special_tokens_map.json",
                    r#"{"bos_token": "<map-s>", "pad_token": "<map-pad>"}"#,
                )],
            ),
            conversation(),
        ),
        (
            "jinja_file",
            model_dir(
                root.path(),
                "jinja_file",
                plain("STALE {{ messages[0].content }}"),
                &[("chat_template.jinja", WHITESPACE)],
            ),
            conversation(),
        ),
        (
            "refusal",
            model_dir(root.path(), "refusal", plain(NO_SYSTEM), &[]),
            conversation(),
        ),
        (
            "refusal_passes",
            model_dir(root.path(), "refusal_passes", plain(NO_SYSTEM), &[]),
            without_system,
        ),
    ];

    let jobs: Vec<Value> = cases
        .iter()
        .map(|(_, dir, messages)| json!({"dir": dir, "messages": messages}))
        .collect();
    let jobs_path = root.path().join("jobs.json");
    std::fs::write(&jobs_path, Value::from(jobs).to_string()).unwrap();
    let output = Command::new(python())
        .arg(workspace_root().join("tests/python/chat_templates.py"))
        .arg(&jobs_path)
        .output()
        .expect("run chat_templates.py");
    assert!(
        output.status.success(),
        "chat_templates.py failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let references: Vec<Value> = serde_json::from_slice(&output.stdout).expect("one JSON list");
    assert_eq!(references.len(), cases.len());

    for ((name, dir, messages), reference) in cases.iter().zip(&references) {
        let rendered = ChatTemplate::load(dir).and_then(|template| template.render(messages));
        match (
            &rendered,
            reference["ok"].as_str(),
            reference["error"].as_str(),
        ) {
            (Ok(prompt), Some(expected), _) => assert_eq!(prompt, expected, "{name}"),
            (Err(error), None, Some(expected)) => {
                // Both refuse, with the template's own message.
                let message = expected.split_once(": ").map_or(expected, |(_, m)| m);
                assert!(
                    error.to_string().contains(message),
                    "{name}: {error} / {expected}"
                );
            }
            (rendered, _, _) => panic!("{name}: canarygate {rendered:?}, transformers {reference}"),
        }
    }
    // The cases above do what they are for.
    let prompt_of = |name: &str| {
        let index = cases.iter().position(|(case, ..)| *case == name).unwrap();
        references[index]["ok"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };
    assert!(prompt_of("whitespace").starts_with("<s>\n<<SYS>>You are terse.<</SYS>>\n[user]"));
    assert!(prompt_of("python_methods").contains("CMD:search|Rivers Of Europe"));
    assert!(
        prompt_of("tojson")
            .contains(r#"{"name": "lookup", "args": [1, 2.5, "é", "<b>&</b>", null, true]}"#)
    );
    assert!(prompt_of("no_tools").starts_with("no tools|True|True|True|6"));
    assert!(prompt_of("jinja_file").starts_with("<s>\n<<SYS>>"));
    let refusal = cases
        .iter()
        .position(|(case, ..)| *case == "refusal")
        .unwrap();
    assert!(
        references[refusal]["error"]
            .as_str()
            .is_some_and(|e| e.contains("System role not supported"))
    );
}
