//! A provider's response body as the request path reads it: hyper's, with
//! what was read ahead of it to tell its format given back first
//! ([`UpstreamBody::first_byte`]: some OpenAI-compatible servers label their
//! streams `application/json`).

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Frame, Incoming, SizeHint};
use tokio::time::Instant;

/// Most bytes [`UpstreamBody::first_byte`] reads ahead looking for one
/// that is not whitespace.
const MAX_READ_AHEAD: usize = 64 * 1024;

/// A provider's response body as it arrives, with what was read ahead of
/// it to tell its format ([`UpstreamBody::first_byte`]) given back first.
#[derive(Debug)]
pub struct UpstreamBody {
    incoming: Incoming,
    /// When the response head arrived: the body's deadlines count from it.
    head_at: Instant,
    /// Data frames read ahead, not yet given back, and their bytes.
    ahead: VecDeque<Bytes>,
    ahead_len: usize,
    /// The error reading ahead ended with, given back after `ahead`.
    failed: Option<hyper::Error>,
}

impl From<Incoming> for UpstreamBody {
    fn from(incoming: Incoming) -> Self {
        Self {
            incoming,
            head_at: Instant::now(),
            ahead: VecDeque::new(),
            ahead_len: 0,
            failed: None,
        }
    }
}

impl UpstreamBody {
    /// When the response head arrived (when this body was made from it).
    pub fn head_at(&self) -> Instant {
        self.head_at
    }

    /// The body's first byte that is not whitespace, read ahead until
    /// `whole` after the head (and given back when the body is read);
    /// `None` when the body ends or fails first, takes longer, or sends
    /// more than [`MAX_READ_AHEAD`] bytes of whitespace.
    pub async fn first_byte(&mut self, whole: Duration) -> Option<u8> {
        let by = self.head_at + whole;
        let not_space = |bytes: &Bytes| {
            bytes
                .iter()
                .copied()
                .find(|byte| !byte.is_ascii_whitespace())
        };
        if let Some(byte) = self.ahead.iter().find_map(not_space) {
            return Some(byte);
        }
        let read_ahead = async {
            while self.failed.is_none() && self.ahead_len < MAX_READ_AHEAD {
                match self.incoming.frame().await? {
                    Err(error) => self.failed = Some(error),
                    Ok(frame) => {
                        // Trailers (HTTP/2) carry no answer.
                        let Ok(data) = frame.into_data() else {
                            continue;
                        };
                        let found = not_space(&data);
                        self.ahead_len += data.len();
                        self.ahead.push_back(data);
                        if found.is_some() {
                            return found;
                        }
                    }
                }
            }
            None
        };
        // Cut short, nothing is lost: a frame is either read or still there.
        tokio::time::timeout_at(by, read_ahead).await.ok().flatten()
    }
}

impl hyper::body::Body for UpstreamBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        if let Some(ahead) = this.ahead.pop_front() {
            this.ahead_len -= ahead.len();
            return Poll::Ready(Some(Ok(Frame::data(ahead))));
        }
        if let Some(error) = this.failed.take() {
            return Poll::Ready(Some(Err(error)));
        }
        Pin::new(&mut this.incoming).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.ahead.is_empty() && self.failed.is_none() && self.incoming.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let ahead = self.ahead_len as u64;
        let rest = self.incoming.size_hint();
        let mut hint = SizeHint::new();
        hint.set_lower(rest.lower() + ahead);
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper + ahead);
        }
        hint
    }
}
