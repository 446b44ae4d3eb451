//! `POST /v1/embeddings`: a vector per input.
//!
//! Read as OpenAI documents it: `input` a string, a list of strings, a list
//! of token ids or a list of such lists (at most 2048 inputs, none empty,
//! each at most 8192 tokens), `dimensions` (1..=1536, the native size),
//! `encoding_format` `float` or `base64` (little-endian `f32`s, what the
//! openai SDK asks for when its caller names no format).
//!
//! Each input is its own conversation through the shared pipeline, so the
//! failure modes reach embeddings too: a swapped or stale context embeds
//! someone else's text. A vector is the feature hash of the context's
//! lowercased tokens (each token adds ±1 to a dimension chosen by its
//! hash), truncated to `dimensions` and scaled to unit length: the same
//! text always gives the same vector, and texts sharing words point alike.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use canarygate_policies::tokens::pieces;
use serde_json::{Value, json};

use super::exchange::{Sim, begin, finish, openai_key};
use crate::conversation::{CacheRule, Conversation, Turn};
use crate::delivery::{Rendered, deliver};
use crate::error::SimError;
use crate::hash;
use crate::headers::RateSnapshot;
use crate::model::Segment;
use crate::request::{Generation, bounded, parse_json};
use crate::surface::Surface;

/// The size of a vector when `dimensions` is not given.
pub const NATIVE_DIMENSIONS: usize = 1536;

/// Most inputs per request (OpenAI's API reference).
pub const MAX_INPUTS: usize = 2048;

/// Most tokens per input (OpenAI's API reference).
pub const MAX_INPUT_TOKENS: u64 = 8192;

/// The handler.
pub async fn create(State(sim): State<Sim>, headers: HeaderMap, body: Bytes) -> Response {
    let mut exchange = begin(&sim, Surface::Embeddings);
    let result = serve(&sim, &headers, &body, &mut exchange.rate).await;
    finish(&sim, exchange, result)
}

async fn serve(
    sim: &Sim,
    headers: &HeaderMap,
    body: &[u8],
    rate: &mut Option<RateSnapshot>,
) -> Result<Response, SimError> {
    openai_key(sim, headers)?;
    let request = EmbeddingsRequest::parse(body)?;
    let turn = Turn {
        surface: Surface::Embeddings,
        generation: Generation::plain(request.model.clone()),
        conversations: request
            .inputs
            .iter()
            .map(|input| Conversation::text(input.clone(), CacheRule::Off))
            .collect(),
    };
    if let Some(index) = turn
        .conversations
        .iter()
        .position(|input| input.prompt_tokens() > MAX_INPUT_TOKENS)
    {
        return Err(SimError::invalid_request(
            Some("context_length_exceeded"),
            format!(
                "This model's maximum context length is {MAX_INPUT_TOKENS} tokens; input \
                 {index} has {} tokens. Please reduce the length of the input.",
                turn.conversations[index].prompt_tokens()
            ),
        )
        .with_param("input"));
    }
    let run = sim.run(headers, &turn, rate).await?;
    let vectors: Vec<Vec<f32>> = run
        .views
        .iter()
        .map(|view| embed(&view.context, request.dimensions))
        .collect();
    let prompt_tokens = run.views.iter().map(|view| view.prompt_tokens).sum();
    let body = render(&request, &vectors, prompt_tokens).to_string();
    Ok(deliver(
        sim,
        &run,
        Rendered::Whole {
            body,
            decode_steps: 0,
        },
    )
    .await)
}

#[derive(serde::Deserialize)]
struct EmbeddingsBody {
    model: String,
    #[serde(default)]
    input: Option<Value>,
    #[serde(default)]
    encoding_format: Option<String>,
    #[serde(default)]
    dimensions: Option<Value>,
}

/// An embeddings request.
#[derive(Debug, PartialEq)]
pub struct EmbeddingsRequest {
    pub model: String,
    /// One text per input (token ids written out, one token each).
    pub inputs: Vec<String>,
    pub base64: bool,
    pub dimensions: usize,
}

impl EmbeddingsRequest {
    /// Parses and validates a body (400 naming the `param` otherwise).
    pub fn parse(body: &[u8]) -> Result<Self, SimError> {
        let body: EmbeddingsBody = parse_json(body)?;
        let invalid = |message: &str| {
            SimError::invalid_request(Some("invalid_value"), message).with_param("input")
        };
        let ids = |list: &[Value]| -> Option<String> {
            let ids: Option<Vec<String>> = list
                .iter()
                .map(|id| id.as_u64().map(|id| id.to_string()))
                .collect();
            ids.filter(|ids| !ids.is_empty()).map(|ids| ids.join(" "))
        };
        let inputs = match &body.input {
            None | Some(Value::Null) => {
                return Err(SimError::invalid_request(
                    None,
                    "Missing required parameter: 'input'.",
                )
                .with_param("input"));
            }
            Some(Value::String(text)) => vec![text.clone()],
            Some(Value::Array(list)) if !list.is_empty() && list.iter().all(Value::is_number) => {
                vec![ids(list).ok_or_else(|| {
                    invalid("Invalid 'input': token ids must be non-negative integers.")
                })?]
            }
            Some(Value::Array(list)) if !list.is_empty() => list
                .iter()
                .map(|item| match item {
                    Value::String(text) => Ok(text.clone()),
                    Value::Array(tokens) => ids(tokens).ok_or_else(|| {
                        invalid("Invalid 'input': each token list must hold token ids.")
                    }),
                    _ => Err(invalid(
                        "Invalid 'input': expected strings or token id lists.",
                    )),
                })
                .collect::<Result<_, _>>()?,
            Some(_) => {
                return Err(invalid(
                    "Invalid 'input': expected a string, an array of strings or token ids, \
                     not empty.",
                ));
            }
        };
        if inputs.len() > MAX_INPUTS {
            return Err(invalid(&format!(
                "Invalid 'input': at most {MAX_INPUTS} inputs per request, got {}.",
                inputs.len()
            )));
        }
        if inputs.iter().any(String::is_empty) {
            return Err(invalid("Invalid 'input': an input must not be empty."));
        }
        let base64 = match body.encoding_format.as_deref() {
            None | Some("float") => false,
            Some("base64") => true,
            Some(other) => {
                return Err(SimError::invalid_request(
                    Some("invalid_value"),
                    format!(
                        "Invalid value for 'encoding_format': '{other}' is not 'float' or 'base64'."
                    ),
                )
                .with_param("encoding_format"));
            }
        };
        let dimensions = bounded(
            body.dimensions.as_ref(),
            "dimensions",
            1,
            NATIVE_DIMENSIONS as u64,
        )?
        .map_or(NATIVE_DIMENSIONS, |d| d as usize);
        Ok(Self {
            model: body.model,
            inputs,
            base64,
            dimensions,
        })
    }
}

/// The unit vector of what the model sees, `dimensions` long (see the
/// module docs).
pub fn embed(context: &[Segment], dimensions: usize) -> Vec<f32> {
    let mut vector = vec![0f32; NATIVE_DIMENSIONS];
    for segment in context {
        for piece in pieces(&segment.text) {
            let seed = hash::of(&[piece.to_lowercase().as_bytes()]);
            let sign = if seed >> 63 == 1 { -1.0 } else { 1.0 };
            vector[(seed % NATIVE_DIMENSIONS as u64) as usize] += sign;
        }
    }
    vector.truncate(dimensions.clamp(1, NATIVE_DIMENSIONS));
    let norm = vector.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm == 0.0 {
        // Nothing to hash: a fixed direction.
        vector[0] = 1.0;
        return vector;
    }
    vector.iter_mut().for_each(|x| *x /= norm);
    vector
}

/// The `list` body of `vectors`, one per input.
pub fn render(request: &EmbeddingsRequest, vectors: &[Vec<f32>], prompt_tokens: u64) -> Value {
    let data: Vec<Value> = vectors
        .iter()
        .enumerate()
        .map(|(index, vector)| {
            let embedding = if request.base64 {
                json!(base64_f32(vector))
            } else {
                json!(vector)
            };
            json!({"object": "embedding", "index": index, "embedding": embedding})
        })
        .collect();
    json!({
        "object": "list",
        "data": data,
        "model": request.model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    })
}

/// `values` as little-endian `f32` bytes in standard base64 (RFC 4648 §4,
/// padded).
pub fn base64_f32(values: &[f32]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes: Vec<u8> = values
        .iter()
        .flat_map(|value| value.to_le_bytes())
        .collect();
    base64(&bytes, ALPHABET)
}

fn base64(bytes: &[u8], alphabet: &[u8; 64]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for group in bytes.chunks(3) {
        let word = group.iter().enumerate().fold(0u32, |word, (index, byte)| {
            word | u32::from(*byte) << (16 - 8 * index)
        });
        for index in 0..4 {
            if index <= group.len() {
                out.push(char::from(
                    alphabet[(word >> (18 - 6 * index) & 63) as usize],
                ));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segment(text: &str) -> Vec<Segment> {
        vec![Segment {
            role: "user".into(),
            text: text.into(),
        }]
    }

    fn cosine(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }

    #[test]
    fn base64_follows_rfc_4648() {
        const ALPHABET: &[u8; 64] =
            b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        // RFC 4648 §10's test vectors.
        for (plain, encoded) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(plain.as_bytes(), ALPHABET), encoded);
        }
        assert_eq!(base64_f32(&[1.0]), "AACAPw==", "1.0f32 is 00 00 80 3f");
    }

    #[test]
    fn vectors_are_unit_deterministic_and_alike_for_alike_texts() {
        let harbour = embed(&segment("the harbour survey at dawn"), NATIVE_DIMENSIONS);
        assert_eq!(harbour.len(), NATIVE_DIMENSIONS);
        assert!((cosine(&harbour, &harbour) - 1.0).abs() < 1e-5);
        assert_eq!(
            harbour,
            embed(&segment("the harbour survey at dawn"), NATIVE_DIMENSIONS)
        );
        let close = embed(&segment("The harbour survey at noon"), NATIVE_DIMENSIONS);
        let far = embed(&segment("quarterly revenue figures"), NATIVE_DIMENSIONS);
        assert!(cosine(&harbour, &close) > 0.5);
        assert!(cosine(&harbour, &far) < cosine(&harbour, &close));
        let short = embed(&segment("the harbour survey at dawn"), 8);
        assert_eq!(short.len(), 8);
        assert!((cosine(&short, &short) - 1.0).abs() < 1e-5);
    }

    #[test]
    fn inputs_and_formats_are_checked() {
        let parse = |body: Value| EmbeddingsRequest::parse(body.to_string().as_bytes());
        let request = parse(
            json!({"model": "m", "input": ["a b", [1, 2]], "dimensions": 8,
            "encoding_format": "base64"}),
        )
        .unwrap();
        assert_eq!(request.inputs, ["a b", "1 2"]);
        assert!(request.base64);
        assert_eq!(request.dimensions, 8);
        for (body, param) in [
            (json!({"model": "m", "input": ""}), "input"),
            (json!({"model": "m", "input": []}), "input"),
            (json!({"model": "m", "input": [[]]}), "input"),
            (json!({"model": "m"}), "input"),
            (
                json!({"model": "m", "input": "x", "encoding_format": "hex"}),
                "encoding_format",
            ),
            (
                json!({"model": "m", "input": "x", "dimensions": 0}),
                "dimensions",
            ),
            (
                json!({"model": "m", "input": "x", "dimensions": 1537}),
                "dimensions",
            ),
        ] {
            assert_eq!(
                parse(body.clone()).unwrap_err().param(),
                Some(param),
                "{body}"
            );
        }
    }
}
