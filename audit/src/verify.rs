//! Recomputing the hash chain.

use crate::AuditError;
use crate::record::{Entry, GENESIS_HASH, RecordId, chain_hash, parse_hash, sha256_hex};
use crate::store::ReadView;

/// A chain that verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainReport {
    /// Records checked.
    pub records: u64,
    /// First and last id, when any record exists.
    pub range: Option<(RecordId, RecordId)>,
    /// Hash of the last record: anchor it elsewhere to detect truncation.
    pub head_hash: [u8; 32],
}

const PAGE: usize = 1024;

/// Walks the whole chain from its start (or the last prune's checkpoint) and
/// returns [`AuditError::Tampered`] naming the first record that does not fit.
pub(crate) fn verify_chain(view: &dyn ReadView) -> Result<ChainReport, AuditError> {
    let tampered = |message: String| Err(AuditError::Tampered(message));
    let (start_id, start_prev) = view.chain_start()?;
    let mut expected = start_id;
    let mut prev = start_prev;
    let mut checkpoint: Option<(RecordId, [u8; 32])> = None;
    let mut count = 0;
    let mut from = 0;
    loop {
        let page = view.records_from(from, PAGE)?;
        let Some(last) = page.last() else { break };
        from = last.key + 1;
        for raw in page {
            let key = raw.key;
            if key < expected {
                return tampered(format!(
                    "record {key}: stored before the start of the chain (id {expected}); inserted?"
                ));
            }
            if key > expected {
                return tampered(format!(
                    "record {expected}: missing (the next stored record is {key}); deleted?"
                ));
            }
            if chain_hash(&raw.body) != raw.hash {
                return tampered(format!(
                    "record {key}: contents changed (its hash does not match its bytes)"
                ));
            }
            let record = raw
                .parse()
                .map_err(|error| AuditError::Tampered(error.to_string()))?;
            if record.id != key {
                return tampered(format!(
                    "record {key}: holds record {} (moved or swapped)",
                    record.id
                ));
            }
            if parse_hash(&record.prev_hash) != Some(prev) {
                return tampered(format!(
                    "record {key}: does not chain onto record {} (inserted, reordered, or an \
                     earlier record was replaced)",
                    key.saturating_sub(1)
                ));
            }
            let stored_sample = view.sample(key)?;
            let may_have_sample = matches!(record.entry, Entry::Request(_) | Entry::Topic(_));
            match (record.entry.sample(), stored_sample) {
                (Some(listed), Some(sample)) if listed.sha256 == sha256_hex(&sample) => {}
                (Some(_), Some(_)) => {
                    return tampered(format!("record {key}: its sample was changed"));
                }
                (Some(_), None) => {
                    return tampered(format!("record {key}: its sample was deleted"));
                }
                (None, Some(_)) if !may_have_sample => {
                    return tampered(format!("record {key}: has a sample but is not a request"));
                }
                (None, Some(_)) => {
                    return tampered(format!(
                        "record {key}: a sample was added that the record does not list"
                    ));
                }
                (None, None) => {}
            }
            match &record.entry {
                Entry::Checkpoint(point) => {
                    let hash = parse_hash(&point.first_kept_prev_hash).ok_or_else(|| {
                        AuditError::Tampered(format!("record {key}: checkpoint hash is malformed"))
                    })?;
                    checkpoint = Some((point.first_kept_id, hash));
                }
                Entry::Request(_) | Entry::Review(_) | Entry::Topic(_) => {}
            }
            prev = raw.hash;
            expected = key + 1;
            count += 1;
        }
    }
    let pruned = (start_id, start_prev) != (1, GENESIS_HASH);
    match checkpoint {
        Some(point) if point != (start_id, start_prev) => {
            return tampered(format!(
                "the chain starts at record {start_id}, but the last checkpoint says {}",
                point.0
            ));
        }
        None if pruned => {
            return tampered(format!(
                "the chain starts at record {start_id} but no checkpoint record explains \
                 why records before it are gone"
            ));
        }
        _ => {}
    }
    if let Some(orphan) = view
        .sampled_ids()?
        .into_iter()
        .find(|id| *id >= expected || *id < start_id)
    {
        return tampered(format!(
            "record {orphan}: a sample exists for a record that does not"
        ));
    }
    Ok(ChainReport {
        records: count,
        range: (count > 0).then(|| (start_id, expected - 1)),
        head_hash: prev,
    })
}
