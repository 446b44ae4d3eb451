//! What every surface's handler shares: counting a request in, the
//! provider's headers on its response, the OpenAI surfaces' key check.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Instant, SystemTime};

use axum::http::{HeaderMap, header};
use axum::response::Response;

use crate::error::{ErrorShape, SimError};
use crate::headers::{self, RateSnapshot};
use crate::provider::SimProvider;
use crate::surface::Surface;

/// One request being answered: when it came, its request-id number, and
/// what the rate limit reported when it was admitted.
pub struct Exchange {
    surface: Surface,
    started: Instant,
    number: u64,
    pub rate: Option<RateSnapshot>,
}

/// Counts a generation request of `surface` as it arrives.
pub fn begin(sim: &SimProvider, surface: Surface) -> Exchange {
    Exchange {
        surface,
        started: Instant::now(),
        number: sim.arrive(surface),
        rate: None,
    }
}

/// A request that generates nothing (a stored response fetched or deleted,
/// tokens counted): answered with its provider's headers, not counted.
pub fn begin_uncounted(sim: &SimProvider, surface: Surface) -> Exchange {
    Exchange {
        surface,
        started: Instant::now(),
        // Numbered apart from generation requests, for unique request ids.
        number: u64::MAX / 2 + sim.stats.lookups.fetch_add(1, Ordering::Relaxed),
        rate: None,
    }
}

/// The response to `exchange`: `result`, or its error in the surface's
/// shape, with the provider's headers (the rate limit as admitted, else the
/// window as it stands).
pub fn finish(
    sim: &SimProvider,
    exchange: Exchange,
    result: Result<Response, SimError>,
) -> Response {
    let shape = exchange.surface.error_shape();
    let request_id = match shape {
        ErrorShape::OpenAi => headers::request_id(exchange.number, sim.started_nanos),
        ErrorShape::Anthropic => headers::anthropic_request_id(exchange.number, sim.started_nanos),
    };
    let mut response = match result {
        Ok(response) => response,
        Err(error) => {
            let counter = if error.status() == 429 {
                &sim.stats.rate_limited
            } else if error.is_overloaded() {
                &sim.stats.overloaded
            } else {
                &sim.stats.rejected
            };
            counter.fetch_add(1, Ordering::Relaxed);
            error.render(shape, &request_id)
        }
    };
    let rate = exchange.rate.unwrap_or_else(|| {
        sim.rate
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .peek(exchange.started, None)
    });
    match shape {
        ErrorShape::OpenAi => headers::insert(
            response.headers_mut(),
            &request_id,
            exchange.started.elapsed(),
            &rate,
        ),
        ErrorShape::Anthropic => headers::insert_anthropic(
            response.headers_mut(),
            &request_id,
            &rate,
            SystemTime::now(),
        ),
    }
    response
}

/// Checks OpenAI's `Authorization: Bearer <key>`.
pub fn openai_key(sim: &SimProvider, headers: &HeaderMap) -> Result<(), SimError> {
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
        .ok_or_else(|| {
            SimError::unauthorized("missing_api_key", "You didn't provide an API key.")
        })?;
    if sim
        .config
        .api_key
        .as_deref()
        .is_some_and(|key| key != presented)
    {
        return Err(SimError::unauthorized(
            "invalid_api_key",
            "Incorrect API key provided.",
        ));
    }
    Ok(())
}

/// A shared handle on the provider, as the router holds it.
pub type Sim = Arc<SimProvider>;
