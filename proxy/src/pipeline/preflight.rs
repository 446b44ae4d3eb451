//! The context preflight: a request over the provider's trusted limit is
//! served locally or rejected, before anything is sent upstream.

use canarygate_audit::CheckRecord;
use canarygate_policies::config::ResolvedRoute;
use canarygate_policies::context::{ContextDemand, TrustedLimit, trusted_limit};
use canarygate_policies::verify::Status;
use serde_json::json;

use crate::context::RequestContext;
use crate::trail::Trail;
use crate::wire::{ClientRequest, WireFormat};

/// A request the provider cannot be trusted with.
pub struct OverLimit {
    /// What the request needs.
    pub demand: ContextDemand,
    /// What the provider is trusted with.
    pub limit: TrustedLimit,
}

/// Whether `request` (`body_len` bytes as received) fits the context the
/// route's provider is trusted with; `Some` (recorded in `trail` as a failed
/// `context_claim` check) when it does not.
pub fn check<W: WireFormat>(
    context: &RequestContext<'_, W>,
    request: &ClientRequest,
    body_len: usize,
    route: &ResolvedRoute<'_>,
    trail: &mut Trail,
) -> Option<OverLimit> {
    let state = context.state;
    let verify = state.policy.verify.enabled.then(|| context.echo_cost());
    let probed = state
        .probes
        .get(route.provider, route.upstream_model)
        .map(|result| result.effective_limit_tokens);
    let limit = trusted_limit(route.context_window, probed, route.max_context_tokens);
    // No count can exceed the body's length in bytes (every token, ours or a
    // tokenizer's, covers at least one byte of it): most requests fit
    // without counting.
    if ContextDemand::new(body_len as u64, request.max_tokens, verify).fits(limit) {
        return None;
    }
    let prompt_tokens = context
        .upstream
        .prompt_tokens(&W::prompt_messages(&request.body));
    let demand = ContextDemand::new(prompt_tokens, request.max_tokens, verify);
    if demand.fits(limit) {
        return None;
    }
    trail.prompt_tokens_ours(prompt_tokens);
    trail.check(CheckRecord {
        name: "context_claim".into(),
        result: Status::Fail,
        evidence: json!({
            "reason": "prompt plus max_tokens exceed the provider's trusted context",
            "seen": {"demand": demand, "limit": limit, "advertised": route.context_window,
                     "probed": probed, "cap": route.max_context_tokens},
        })
        .into(),
    });
    Some(OverLimit { demand, limit })
}

impl OverLimit {
    /// Why the request is refused, for the client.
    pub fn message(&self, route: &ResolvedRoute<'_>) -> String {
        let Self { demand, limit } = self;
        format!(
            "This request needs {} tokens ({} in the prompt with canarygate's additions, {} to \
             generate), more than the {} tokens provider `{}` is trusted with for `{}` ({}). \
             Shorten the messages or lower max_tokens.",
            demand.total(),
            demand.prompt_tokens,
            demand.completion_tokens,
            limit.tokens,
            route.provider,
            route.upstream_model,
            limit.source.name()
        )
    }
}
