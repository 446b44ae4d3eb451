//! One attempt's request, ready to send: fresh canaries placed and
//! registered, the body encoded, its prompt tokens counted.
//!
//! With a shared registry, claiming the canaries is a network round trip.
//! It runs in a task of its own while this one counts the prompt's tokens
//! and encodes the body, and is awaited before anything is sent: the
//! request never goes upstream before another instance could recognise its
//! canaries.

use std::sync::Arc;

use axum::body::Bytes;
use canarygate_policies::EchoCost;
use canarygate_policies::inject::{Injection, echo_for_request};
use serde_json::Value;
use tokio::task::JoinHandle;

use crate::context::RequestContext;
use crate::error::{ApiError, ErrorCode};
use crate::registry::{CanaryBook, Minted, Owner, RegisterError, Registered};
use crate::wire::WireFormat;

/// Most draws of a request's canaries: a value another instance holds live
/// is drawn again (odds about 10^-9 per draw with a million live canaries).
const MAX_DRAWS: u32 = 4;

/// A request with its canaries, registered, as it goes upstream.
pub struct Prepared {
    /// The body, encoded.
    pub bytes: Bytes,
    /// What the placement asks of the answer.
    pub injection: Injection,
    /// The prompt's tokens by the provider's tokenizer, when it has one.
    pub exact_prompt_tokens: Option<u64>,
    /// The canaries' ids, and whether the shared registry was skipped.
    pub registered: Registered,
}

/// Places fresh canaries in `body` (the echo costed at `cost`), registers
/// them and encodes the body. A
/// draw the shared registry refuses (a value is another request's) is
/// withdrawn and fresh canaries placed in the body parsed again from
/// `original`.
pub async fn prepare<W: WireFormat>(
    context: &RequestContext<'_, W>,
    body: Value,
    original: &Bytes,
    cost: EchoCost,
) -> Result<Prepared, ApiError> {
    let config = &context.state.policy.verify;
    let registry = &context.state.registry;
    let echo = echo_for_request(config.echo, original);
    let mut unused = Some(body);
    for _ in 0..MAX_DRAWS {
        let mut body = match unused.take() {
            Some(body) => body,
            None => context.reparse(original)?.body,
        };
        let owner = Owner {
            session: &context.caller.session_id,
            request_id: &context.request_id,
        };
        let minted = registry.mint(owner, config.canary_ttl_secs);
        let placed = W::place_canaries(
            &mut body,
            echo,
            cost,
            minted.canaries,
            context.system_role(),
        );
        let injection = match placed {
            Ok(injection) => injection,
            Err(error) => {
                registry.withdraw(minted);
                return Err(error);
            }
        };
        let claim = Claim::start(registry, minted);
        let exact_prompt_tokens = context
            .upstream
            .count_prompt_tokens(&W::prompt_messages(&body));
        let encoded = serde_json::to_vec(&body).map_err(|error| {
            ApiError::internal(format!("re-encoding the request failed: {error}"))
        });
        let (minted, outcome) = claim.finish(registry).await?;
        match outcome {
            Ok(registered) => match encoded {
                Ok(bytes) => {
                    return Ok(Prepared {
                        bytes: Bytes::from(bytes),
                        injection,
                        exact_prompt_tokens,
                        registered,
                    });
                }
                Err(error) => {
                    registry.withdraw(minted);
                    return Err(error);
                }
            },
            Err(RegisterError::Taken) => {
                registry.withdraw(minted);
                tracing::info!(
                    request_id = %context.request_id,
                    "a canary drawn is live on another instance; drawing again"
                );
            }
            Err(RegisterError::Unavailable(error)) => {
                registry.withdraw(minted);
                context.state.metrics.registry_unavailable("refused");
                return Err(ApiError::new(
                    ErrorCode::RegistryUnavailable,
                    format!(
                        "canarygate cannot reach its shared canary registry ({error}) and the \
                         policy fails closed: the request was not sent."
                    ),
                ));
            }
        }
    }
    Err(ApiError::internal(format!(
        "{MAX_DRAWS} draws of canaries were all live already on other instances"
    )))
}

/// A registration under way.
enum Claim {
    /// In-memory registry: nothing to wait for; registered when finished.
    Local(Minted),
    /// Shared registry: the round trip runs in its own task.
    Shared(JoinHandle<(Minted, Result<Registered, RegisterError>)>),
}

impl Claim {
    fn start(registry: &Arc<CanaryBook>, minted: Minted) -> Self {
        if !registry.is_shared() {
            return Self::Local(minted);
        }
        let registry = Arc::clone(registry);
        Self::Shared(tokio::spawn(async move {
            let outcome = registry.register(&minted).await;
            (minted, outcome)
        }))
    }

    async fn finish(
        self,
        registry: &CanaryBook,
    ) -> Result<(Minted, Result<Registered, RegisterError>), ApiError> {
        match self {
            Self::Local(minted) => {
                let outcome = registry.register(&minted).await;
                Ok((minted, outcome))
            }
            Self::Shared(task) => task.await.map_err(|error| {
                ApiError::internal(format!("registering the canaries failed: {error}"))
            }),
        }
    }
}
