//! Context probe results in the data directory: written by `canarygate
//! probe` (or `serve`'s scheduled probes) as JSON, one file per provider and
//! model, atomically, and read by `serve` into a [`ProbeBook`] that the
//! context preflight asks.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use canarygate_policies::probe::ProbeResult;

/// Folder of probe results inside the data directory.
pub const PROBES_DIR: &str = "probes";

/// File name of the result for `provider` and `model`.
fn result_file(data_dir: &Path, provider: &str, model: &str) -> PathBuf {
    let clean = |text: &str| -> String {
        text.chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                    c
                } else {
                    '_'
                }
            })
            .collect()
    };
    data_dir
        .join(PROBES_DIR)
        .join(format!("{}--{}.json", clean(provider), clean(model)))
}

/// A probe result could not be stored.
#[derive(Debug, thiserror::Error)]
#[error("cannot write {path}: {source}")]
pub struct StoreError {
    /// The file or directory.
    pub path: PathBuf,
    /// Why.
    #[source]
    pub source: std::io::Error,
}

/// Writes `result` into `data_dir` (atomically, owner-only) and returns the
/// file.
pub fn store(data_dir: &Path, result: &ProbeResult) -> Result<PathBuf, StoreError> {
    let path = result_file(data_dir, &result.provider, &result.model);
    // A result of numbers and strings always serialises.
    let text = serde_json::to_vec_pretty(result).unwrap_or_default();
    // Owner-only, like everything in the data directory.
    canarygate_audit::files::write_private_file(&path, &text).map_err(|source| StoreError {
        path: path.clone(),
        source,
    })?;
    Ok(path)
}

/// The probe results of a data directory, as `serve` uses them.
pub struct ProbeBook {
    dir: PathBuf,
    /// Provider name, then model name.
    results: RwLock<HashMap<String, HashMap<String, Arc<ProbeResult>>>>,
}

impl ProbeBook {
    /// Reads every result in `data_dir` (none is fine).
    pub fn open(data_dir: &Path) -> Self {
        let book = Self {
            dir: data_dir.join(PROBES_DIR),
            results: RwLock::new(HashMap::new()),
        };
        book.reload();
        book
    }

    /// Re-reads the results from disk; unreadable files are skipped with a warning.
    pub fn reload(&self) {
        let mut results = HashMap::new();
        if let Ok(entries) = std::fs::read_dir(&self.dir) {
            for entry in entries.flatten() {
                let path = entry.path();
                if path.extension().is_none_or(|extension| extension != "json") {
                    continue;
                }
                match std::fs::read(&path)
                    .map_err(|error| error.to_string())
                    .and_then(|bytes| {
                        serde_json::from_slice::<ProbeResult>(&bytes).map_err(|e| e.to_string())
                    }) {
                    Ok(result) => {
                        results
                            .entry(result.provider.clone())
                            .or_insert_with(HashMap::new)
                            .insert(result.model.clone(), Arc::new(result));
                    }
                    Err(error) => {
                        tracing::warn!("skipping probe result {}: {error}", path.display());
                    }
                }
            }
        }
        *self.results.write().unwrap_or_else(|e| e.into_inner()) = results;
    }

    /// The stored result for `provider` and `model`.
    pub fn get(&self, provider: &str, model: &str) -> Option<Arc<ProbeResult>> {
        self.results
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(provider)?
            .get(model)
            .cloned()
    }

    /// Every stored result.
    pub fn all(&self) -> Vec<Arc<ProbeResult>> {
        self.results
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .flat_map(|models| models.values().cloned())
            .collect()
    }
}
