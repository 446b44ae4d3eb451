//! What the pages show, read from one [`Snapshot`]: the filtered rows of
//! the list (and the charts), and one record in full.
//!
//! Blocking (redb reads): the server calls these in `spawn_blocking`.
//! Listing walks the whole log once per page view and keeps a small [`Row`]
//! per matching request, so its time and memory grow with the log.

use std::collections::{BTreeSet, HashMap};

use canarygate_audit::{Action, Route, VerdictSummary};
use canarygate_audit::{
    AuditError, Entry, Record, RecordId, RequestEntry, ReviewEntry, ReviewVerdict, Sample,
    SampleKey, Snapshot, TopicScore,
};
use canarygate_policies::verify::Status;

use crate::filter::{Filter, Order, Reviewed};

/// One request record, as the list shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// Record id.
    pub id: RecordId,
    /// When it was written, unix ms.
    pub recorded_at_ms: u64,
    /// The id the client saw.
    pub request_id: String,
    /// Keyed hash of the session.
    pub session: String,
    /// Provider name.
    pub provider: String,
    /// Client model name.
    pub model: String,
    /// The API endpoint, when recorded.
    pub endpoint: Option<String>,
    /// Upstream or local.
    pub route: Route,
    /// The verdict.
    pub verdict: VerdictSummary,
    /// What was done.
    pub action: Action,
    /// Names of the checks that failed.
    pub failed: Vec<String>,
    /// Whether the record keeps a sample (its own or its topic record's).
    pub sampled: bool,
    /// The topic score, from the record or its topic record.
    pub topic: Option<TopicScore>,
    /// Total latency, ms.
    pub total_ms: u64,
    /// Time spent in the proxy, ms.
    pub overhead_ms: u64,
    /// The review's verdict, when reviewed.
    pub review: Option<ReviewVerdict>,
}

impl Row {
    fn of(record: &Record, request: &RequestEntry) -> Self {
        let r = &request.record;
        Self {
            id: record.id,
            recorded_at_ms: record.recorded_at_ms,
            request_id: r.request_id.clone(),
            session: r.session.clone(),
            provider: r.provider.clone(),
            model: r.model.clone(),
            endpoint: r.endpoint.clone(),
            route: r.route,
            verdict: r.verdict,
            action: r.action,
            failed: r
                .checks
                .iter()
                .filter(|check| check.result == Status::Fail)
                .map(|check| check.name.clone())
                .collect(),
            sampled: request.sample.is_some(),
            topic: r.topic.clone(),
            total_ms: r.latency.total_ms,
            overhead_ms: r.latency.overhead_ms,
            review: None,
        }
    }

    /// 0 for the most suspicious: a failed verdict, then a flagged answer,
    /// then a low topic score, then a sampled answer, then the rest (the
    /// order of [`Snapshot::review_queue`], which holds sampled records only).
    fn suspicion(&self) -> u8 {
        if self.verdict == VerdictSummary::Fail {
            0
        } else if self.action == Action::Flag {
            1
        } else if self.topic_low() {
            2
        } else if self.sampled {
            3
        } else {
            4
        }
    }

    /// The topic similarity; unscored sorts after every score.
    fn similarity(&self) -> f32 {
        self.topic
            .as_ref()
            .and_then(|score| score.similarity)
            .unwrap_or(f32::INFINITY)
    }

    /// The topic score is below its threshold.
    pub fn topic_low(&self) -> bool {
        self.topic.as_ref().is_some_and(TopicScore::low)
    }

    /// Whether the filter admits this row (all but the time bounds, which
    /// are checked on the record).
    fn admitted_by(&self, filter: &Filter) -> bool {
        filter.verdict.is_none_or(|v| v == self.verdict)
            && filter
                .check
                .as_ref()
                .is_none_or(|check| self.failed.contains(check))
            && filter.route.is_none_or(|route| route == self.route)
            && filter
                .session
                .as_ref()
                .is_none_or(|prefix| self.session.starts_with(prefix.as_str()))
            && filter
                .endpoint
                .as_ref()
                .is_none_or(|e| self.endpoint.as_ref() == Some(e))
            && filter
                .request
                .as_ref()
                .is_none_or(|id| &self.request_id == id)
            && (!filter.low_topic || self.topic_low())
            && match filter.reviewed {
                None => true,
                Some(Reviewed::Yes) => self.review.is_some(),
                Some(Reviewed::No) => self.review.is_none(),
            }
    }
}

/// The rows a filter admits, ordered, with what the filter form offers.
#[derive(Debug, Default)]
pub struct Listing {
    /// Matching rows in display order (every page).
    pub rows: Vec<Row>,
    /// Request records in the log, matching or not.
    pub requests: usize,
    /// Every check name that failed somewhere in the log.
    pub failed_checks: BTreeSet<String>,
    /// Every endpoint recorded in the log.
    pub endpoints: BTreeSet<String>,
}

/// Reads the rows `filter` admits (ignoring its page).
pub fn list(snapshot: &Snapshot, filter: &Filter) -> Result<Listing, AuditError> {
    let mut listing = Listing::default();
    let mut reviews: HashMap<RecordId, ReviewVerdict> = HashMap::new();
    let mut topics: HashMap<RecordId, (TopicScore, bool)> = HashMap::new();
    snapshot.for_each(|stored| {
        let record = &stored.record;
        match &record.entry {
            Entry::Request(request) => {
                listing.requests += 1;
                let row = Row::of(record, request);
                listing.failed_checks.extend(row.failed.iter().cloned());
                listing.endpoints.extend(row.endpoint.iter().cloned());
                if filter.admits_time(record.recorded_at_ms) {
                    listing.rows.push(row);
                }
            }
            Entry::Review(review) => {
                reviews.insert(review.reviewed_id, review.verdict);
            }
            Entry::Topic(topic) => {
                topics.insert(
                    topic.scored_id,
                    (topic.score.clone(), topic.sample.is_some()),
                );
            }
            Entry::Checkpoint(_) => {}
        }
        Ok(())
    })?;
    for row in &mut listing.rows {
        row.review = reviews.get(&row.id).copied();
        if let Some((score, sampled)) = topics.remove(&row.id) {
            row.topic = row.topic.take().or(Some(score));
            row.sampled |= sampled;
        }
    }
    listing.rows.retain(|row| row.admitted_by(filter));
    match filter.order {
        Order::Newest => listing.rows.sort_by_key(|row| std::cmp::Reverse(row.id)),
        // As the review queue: oldest first within a rank, so nothing
        // waits forever behind newer records.
        Order::Suspicious => listing.rows.sort_by(|a, b| {
            a.suspicion()
                .cmp(&b.suspicion())
                .then(a.similarity().total_cmp(&b.similarity()))
                .then(a.id.cmp(&b.id))
        }),
    }
    Ok(listing)
}

/// One request record in full.
#[derive(Debug)]
pub struct Detail {
    /// The record.
    pub record: Record,
    /// Its request entry (a copy of `record.entry`'s).
    pub request: RequestEntry,
    /// Its sample (its own or its topic record's), decrypted, or why it
    /// cannot be shown.
    pub sample: Result<Option<Sample>, String>,
    /// Its topic score, and the topic record that holds it when it is not
    /// in the request record.
    pub topic: Option<(TopicScore, Option<RecordId>)>,
    /// Its review: the review record's id and entry.
    pub review: Option<(RecordId, ReviewEntry)>,
}

/// What record `id` is, for the record page.
#[derive(Debug)]
pub enum Found {
    /// A request record.
    Request(Box<Detail>),
    /// A record of another kind (review, checkpoint), as its export line.
    Other(Record, String),
    /// No record with that id.
    Missing,
}

/// Reads record `id`, decrypting its sample with `key`.
pub fn record(
    snapshot: &Snapshot,
    id: RecordId,
    key: Option<&SampleKey>,
    key_env: &str,
) -> Result<Found, AuditError> {
    let Some(stored) = snapshot.get(id)? else {
        return Ok(Found::Missing);
    };
    let request = match &stored.record.entry {
        Entry::Request(request) => (**request).clone(),
        _ => {
            let line = stored.export_line()?;
            return Ok(Found::Other(stored.record, line));
        }
    };
    let sample = match snapshot.request_sample(id, &request.record.request_id, key) {
        Ok(sample) => Ok(sample),
        Err(AuditError::Key(message)) => Err(format!(
            "the sample is encrypted and cannot be read: {message} (set ${key_env} to the \
             sample key)"
        )),
        Err(error) => return Err(error),
    };
    let review = match snapshot.review_of(id)? {
        Some(review_id) => match snapshot.get(review_id)?.map(|stored| stored.record.entry) {
            Some(Entry::Review(review)) => Some((review_id, review)),
            _ => {
                return Err(AuditError::Corrupt(format!(
                    "record {id}: its review {review_id} is not a review record"
                )));
            }
        },
        None => None,
    };
    let topic = snapshot.topic_of(id)?;
    Ok(Found::Request(Box::new(Detail {
        record: stored.record,
        request,
        sample,
        topic,
        review,
    })))
}
