//! The durable point of request records under `[audit] durability =
//! "before_answer"`: an append-only, checksummed journal, synced once per
//! batch of concurrent records.
//!
//! A redb commit in the multi-process mode the store needs (the `audit`
//! commands read it while `serve` writes) syncs the file twice. The journal
//! syncs once: the writer appends every record queued while the disk was busy
//! in one `write`, calls `fdatasync`, and only then answers the requests whose
//! records they are. The index writer moves journaled records into the store
//! afterwards, chaining them in journal order, and writes the last journal
//! sequence number it has indexed in the same transaction, so a record is
//! indexed exactly once whoever does it: the index writer, or after a crash
//! the next process that opens the data directory ([`replay`]).
//!
//! Files, in `DIR/journal/`, all owner-only:
//! - `LOCK`: held (an exclusive `flock`) by the one process that appends.
//!   A process that finds it free after a crash replays what is left.
//! - `NNNNNNNNNNNNNNNNNNNN.wal`: segments, named by the sequence number of
//!   their first entry. A segment is deleted once every entry in it is
//!   indexed; the writer starts a new one past [`SEGMENT_BYTES`].
//! - `spare`: the next segment, being zero-filled off the hot path.
//!
//! Segments are preallocated. Appending to a file changes its size, so every
//! `fdatasync` of an appended segment also commits the filesystem's metadata
//! journal; overwriting blocks that are already allocated and written does
//! not, and costs about 40 % less per sync (bench/README.md, 12-05). Once a
//! segment has taken [`PREPARE_SPARE_AFTER`] bytes (a journal that writes
//! that little does not need it), a helper thread writes [`SEGMENT_BYTES`]
//! of zeros to `spare` and syncs it; the writer renames it to the next
//! segment's name at the next roll-over, or at once when the current segment
//! is a plain appended one. Until a spare is ready, segments are appended;
//! one that cannot be made is tried again in the next segment.
//!
//! A frame is `len: u32 | crc32: u32 | seq: u64 | at_ms: u64 | sample_len:
//! u32 | sample | entry`, little-endian; `len` counts the bytes after itself,
//! the CRC-32 covers the bytes after itself, `sample_len` is `u32::MAX`
//! without a sample, and `entry` is the record's entry as JSON
//! ([`SerializedEntry`]). Zeros where a frame would start, to the end of the
//! file, are a preallocated segment's unused tail. A frame cut short or
//! failing its checksum at the end of the newest segment, with no intact
//! frame after it, is a write the crash interrupted, never acknowledged:
//! reading stops there. Anywhere else it is damage, reported
//! ([`AuditError::Corrupt`]) with nothing indexed or removed: an intact
//! frame after a bad one was written after it, by a later batch once the
//! bad one's had been synced and acknowledged (or, after a power loss that
//! kept a later page of the last batch and not an earlier one, by the same
//! unacknowledged batch: the error says how to cut the segment then).

use std::fs::{self, File, TryLockError};
use std::io::{self, Seek, Write};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::AuditError;
use crate::files::{create_private_dir_all, create_private_file};
use crate::store::{JournalIndex, MAX_BATCH, RedbStore, SerializedEntry, Store, WriteOp};

/// Directory of the journal inside the data directory.
pub const JOURNAL_DIR: &str = "journal";
const LOCK_FILE: &str = "LOCK";
const SEGMENT_SUFFIX: &str = ".wal";
/// The next segment while it is zero-filled (not a segment: no `.wal`).
const SPARE_FILE: &str = "spare";
/// Size past which the writer starts a new segment, and of a preallocated one.
pub(crate) const SEGMENT_BYTES: u64 = 16 << 20;
/// Bytes a segment takes before the next one is preallocated.
pub(crate) const PREPARE_SPARE_AFTER: u64 = 64 << 10;
/// Bytes of a frame before its sample: len, crc, seq, at_ms, sample_len.
const FRAME_HEADER: usize = 4 + 4 + 8 + 8 + 4;
/// Largest frame accepted when reading (a record is at most a few MiB).
const MAX_FRAME: usize = 256 << 20;
/// How long a reader waits for a running writer to index what it journaled.
const CATCH_UP_DEADLINE: Duration = Duration::from_secs(10);

/// One journaled record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Journaled {
    /// Position in the journal, from 1, never reused.
    pub seq: u64,
    /// When it was journaled, unix milliseconds: the record's time.
    pub at_ms: u64,
    /// Its entry, serialised.
    pub entry: Vec<u8>,
    /// Its stored sample bytes, if any.
    pub sample: Option<Vec<u8>>,
}

/// Appends `record` as one frame to `out`.
pub(crate) fn encode(seq: u64, at_ms: u64, entry: &[u8], sample: Option<&[u8]>, out: &mut Vec<u8>) {
    let sample_len = sample.map_or(0, <[u8]>::len);
    let len = 4 + 8 + 8 + 4 + sample_len + entry.len();
    let start = out.len();
    out.extend_from_slice(&(len as u32).to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&at_ms.to_le_bytes());
    match sample {
        Some(sample) => {
            out.extend_from_slice(&(sample.len() as u32).to_le_bytes());
            out.extend_from_slice(sample);
        }
        None => out.extend_from_slice(&u32::MAX.to_le_bytes()),
    }
    out.extend_from_slice(entry);
    let crc = crc32fast::hash(&out[start + 8..]);
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
}

/// How reading a segment ended.
#[derive(Debug, PartialEq, Eq)]
enum Tail {
    /// At the end of the file, or of the frames before a preallocated
    /// segment's unused (all zero) tail.
    Clean,
    /// At a frame cut short or failing its checksum, at this offset, with
    /// no intact frame after it.
    Torn(usize),
    /// At a frame failing its checksum, at offset `at`, with an intact
    /// frame (sequence number `next`) after it.
    Damaged { at: usize, next: u64 },
}

/// The frames of one segment's bytes (its first sequence number
/// `first_seq`), and how reading ended.
fn decode_all(bytes: &[u8], first_seq: u64) -> (Vec<Journaled>, Tail) {
    let mut frames = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        match decode_one(&bytes[at..]) {
            Some((frame, used)) => {
                frames.push(frame);
                at += used;
            }
            None if bytes[at..].iter().all(|&byte| byte == 0) => break,
            None => {
                let before = frames
                    .last()
                    .map_or(first_seq.saturating_sub(1), |frame| frame.seq);
                let tail = match intact_frame_after(bytes, at + 1, before) {
                    Some(next) => Tail::Damaged { at, next },
                    None => Tail::Torn(at),
                };
                return (frames, tail);
            }
        }
    }
    (frames, Tail::Clean)
}

/// The sequence number of the first intact frame that starts at `from` or
/// later in `bytes` and follows `before` in the journal. Only offsets whose
/// sequence number fits (above `before`, by no more frames than the bytes
/// could hold) are decoded, so bytes inside frames cost a comparison each.
fn intact_frame_after(bytes: &[u8], from: usize, before: u64) -> Option<u64> {
    let most = before.saturating_add((bytes.len() / FRAME_HEADER) as u64 + 1);
    (from..bytes.len().saturating_sub(FRAME_HEADER)).find_map(|at| {
        let seq = u64::from_le_bytes(bytes[at + 8..at + 16].try_into().ok()?);
        if seq <= before || seq > most {
            return None;
        }
        decode_one(&bytes[at..]).map(|(frame, _)| frame.seq)
    })
}

/// One frame from the start of `bytes` and its length, or `None` when it is
/// cut short or damaged.
fn decode_one(bytes: &[u8]) -> Option<(Journaled, usize)> {
    let len = u32::from_le_bytes(bytes.get(..4)?.try_into().ok()?) as usize;
    if !(FRAME_HEADER - 4..=MAX_FRAME).contains(&len) {
        return None;
    }
    let frame = bytes.get(4..4 + len)?;
    let crc = u32::from_le_bytes(frame[..4].try_into().ok()?);
    if crc32fast::hash(&frame[4..]) != crc {
        return None;
    }
    let seq = u64::from_le_bytes(frame[4..12].try_into().ok()?);
    let at_ms = u64::from_le_bytes(frame[12..20].try_into().ok()?);
    let sample_len = u32::from_le_bytes(frame[20..24].try_into().ok()?);
    let rest = &frame[24..];
    let (sample, entry) = if sample_len == u32::MAX {
        (None, rest)
    } else {
        let sample_len = sample_len as usize;
        if sample_len > rest.len() {
            return None;
        }
        (Some(rest[..sample_len].to_vec()), &rest[sample_len..])
    };
    let journaled = Journaled {
        seq,
        at_ms,
        entry: entry.to_vec(),
        sample,
    };
    Some((journaled, 4 + len))
}

/// The segments in `dir`, oldest first.
fn segments(dir: &Path) -> Result<Vec<PathBuf>, AuditError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(error) => return Err(io_error(dir, error)),
    };
    let mut found = Vec::new();
    for entry in entries {
        let path = entry.map_err(|error| io_error(dir, error))?.path();
        let name = path
            .file_name()
            .and_then(|name| name.to_str())
            .unwrap_or("");
        if let Some(stem) = name.strip_suffix(SEGMENT_SUFFIX)
            && let Ok(first) = stem.parse::<u64>()
        {
            found.push((first, path));
        }
    }
    found.sort();
    Ok(found.into_iter().map(|(_, path)| path).collect())
}

/// Every intact frame in `dir`, oldest first. A torn frame ends the newest
/// segment only; anywhere else it is [`AuditError::Corrupt`].
fn read_journal(dir: &Path) -> Result<Vec<Journaled>, AuditError> {
    let paths = segments(dir)?;
    let mut all = Vec::new();
    for (n, path) in paths.iter().enumerate() {
        let bytes = match fs::read(path) {
            Ok(bytes) => bytes,
            // Indexed and deleted by the writer since the listing.
            Err(error) if error.kind() == io::ErrorKind::NotFound => continue,
            Err(error) => return Err(io_error(path, error)),
        };
        let (frames, tail) = decode_all(&bytes, first_seq(path));
        match tail {
            Tail::Torn(at) if n + 1 < paths.len() => {
                return Err(AuditError::Corrupt(format!(
                    "journal segment {} is damaged at byte {at}, before newer segments",
                    path.display()
                )));
            }
            Tail::Damaged { at, next } => {
                return Err(AuditError::Corrupt(format!(
                    "journal segment {} is damaged at byte {at}, and intact records follow \
                     it (entry {next} on): records it acknowledged may be lost. Nothing was \
                     indexed or removed. Only if this machine lost power while writing is \
                     the damage a torn write whose records were never acknowledged: then \
                     `truncate -s {at} {}` keeps the records before it and goes on",
                    path.display(),
                    path.display()
                )));
            }
            Tail::Clean | Tail::Torn(_) => {}
        }
        all.extend(frames);
    }
    Ok(all)
}

fn io_error(path: &Path, error: io::Error) -> AuditError {
    AuditError::Io(format!("audit journal {}: {error}", path.display()))
}

/// Indexes every journaled record `store` does not hold yet, in batches.
/// Returns the highest sequence number seen (indexed now or before).
fn index_pending(store: &RedbStore, frames: Vec<Journaled>) -> Result<u64, AuditError> {
    let mut highest = store.read()?.journal_indexed()?;
    let mut batch = Vec::new();
    for frame in frames {
        if frame.seq <= highest {
            continue;
        }
        highest = frame.seq;
        batch.push(WriteOp::Append {
            entry: SerializedEntry::journaled(frame.entry),
            sample: frame.sample,
            journal: Some(JournalIndex {
                seq: frame.seq,
                at_ms: frame.at_ms,
            }),
        });
        if batch.len() == MAX_BATCH {
            store.write(&batch)?;
            batch.clear();
        }
    }
    if !batch.is_empty() {
        store.write(&batch)?;
    }
    Ok(highest)
}

/// Indexes what a writer that has stopped left in `dir`'s journal (after a
/// crash), or waits, up to a deadline, for a running writer to index what it
/// journaled before this call. For the `audit` commands, before they read.
pub(crate) fn catch_up(dir: &Path) -> Result<(), AuditError> {
    let journal = dir.join(JOURNAL_DIR);
    if !journal.is_dir() {
        return Ok(());
    }
    let frames = read_journal(&journal)?;
    let Some(last) = frames.last().map(|frame| frame.seq) else {
        return Ok(());
    };
    if RedbStore::open_read_only(dir)?.read()?.journal_indexed()? >= last {
        return Ok(());
    }
    match lock(&journal)? {
        Some(lock) => {
            // No writer: index what it left, then drop the indexed segments.
            let store = RedbStore::open_writable(dir)?;
            index_pending(&store, read_journal(&journal)?)?;
            remove_segments(&journal, u64::MAX)?;
            drop(lock);
            Ok(())
        }
        None => {
            let store = RedbStore::open_read_only(dir)?;
            let started = Instant::now();
            while store.read()?.journal_indexed()? < last {
                if started.elapsed() > CATCH_UP_DEADLINE {
                    return Err(AuditError::Storage(format!(
                        "the running canarygate has not indexed its audit journal \
                         (entry {last}) within {} s",
                        CATCH_UP_DEADLINE.as_secs()
                    )));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Ok(())
        }
    }
}

/// The exclusive lock on the journal, or `None` when another process (or
/// another handle in this one) holds it.
fn lock(journal: &Path) -> Result<Option<File>, AuditError> {
    let path = journal.join(LOCK_FILE);
    let file = match create_private_file(&path) {
        Ok(file) => file,
        Err(error) if error.kind() == io::ErrorKind::AlreadyExists => fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|error| io_error(&path, error))?,
        Err(error) => return Err(io_error(&path, error)),
    };
    match file.try_lock() {
        Ok(()) => Ok(Some(file)),
        Err(TryLockError::WouldBlock) => Ok(None),
        Err(TryLockError::Error(error)) => Err(io_error(&path, error)),
    }
}

/// Deletes the segments all of whose entries are below `indexed_through`
/// (every segment with `u64::MAX`): a segment's entries end where the next
/// segment starts.
fn remove_segments(journal: &Path, indexed_through: u64) -> Result<(), AuditError> {
    let paths = segments(journal)?;
    let firsts: Vec<u64> = paths.iter().map(|path| first_seq(path)).collect();
    for (n, path) in paths.iter().enumerate() {
        let done = match firsts.get(n + 1) {
            Some(next_first) => next_first.saturating_sub(1) <= indexed_through,
            None => indexed_through == u64::MAX,
        };
        if done {
            remove_if_present(path)?;
        }
    }
    Ok(())
}

fn first_seq(path: &Path) -> u64 {
    path.file_name()
        .and_then(|name| name.to_str())
        .and_then(|name| name.strip_suffix(SEGMENT_SUFFIX))
        .and_then(|stem| stem.parse().ok())
        .unwrap_or(0)
}

/// The appending end of the journal, owned by the journal writer thread.
pub(crate) struct Journal {
    dir: PathBuf,
    /// Held for the writer's life; released by the kernel if it dies.
    _lock: File,
    segment: File,
    segment_len: u64,
    /// Whether the current segment was zero-filled before its first write
    /// (its writes then overwrite, up to [`SEGMENT_BYTES`]).
    preallocated: bool,
    /// The next segment, zero-filled off the hot path.
    spare: Spare,
    next_seq: u64,
    /// First sequence number of the current segment.
    current_first: u64,
    /// First sequence number of every segment but the current one, oldest first.
    sealed: Vec<u64>,
    /// Set by a write that failed and could not be undone: later appends
    /// would land after garbage, so they fail too.
    broken: Option<String>,
}

impl Journal {
    /// Takes the lock, indexes into `store` whatever a crashed writer left,
    /// removes the old segments and starts a new one.
    pub(crate) fn open(dir: &Path, store: &RedbStore) -> Result<Self, AuditError> {
        let journal = dir.join(JOURNAL_DIR);
        create_private_dir_all(&journal).map_err(|error| io_error(&journal, error))?;
        let lock = lock(&journal)?.ok_or_else(|| {
            AuditError::Storage(format!(
                "another process is writing the audit journal in {}: one canarygate serve \
                 per data directory",
                journal.display()
            ))
        })?;
        let highest = index_pending(store, read_journal(&journal)?)?;
        remove_segments(&journal, u64::MAX)?;
        // A spare a crash interrupted may be short; the next one is made anew.
        remove_if_present(&journal.join(SPARE_FILE))?;
        let next_seq = highest + 1;
        let segment = new_segment(&journal, next_seq)?;
        Ok(Self {
            dir: journal,
            _lock: lock,
            segment,
            segment_len: 0,
            preallocated: false,
            spare: Spare::None,
            next_seq,
            current_first: next_seq,
            sealed: Vec::new(),
            broken: None,
        })
    }

    /// The sequence number the next record gets.
    pub(crate) fn take_seq(&mut self) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        seq
    }

    /// Writes `frames` (whole frames from [`encode`]) and syncs them to disk.
    /// On error nothing of them counts: the segment is cut back to where it
    /// was, or, failing that, the journal refuses every later write.
    pub(crate) fn append(&mut self, frames: &[u8]) -> Result<(), AuditError> {
        if let Some(broken) = &self.broken {
            return Err(AuditError::Storage(broken.clone()));
        }
        let result = self
            .segment
            .write_all(frames)
            .and_then(|()| self.segment.sync_data());
        match result {
            Ok(()) if segment_deleted(&self.segment) => {
                // Written and synced into a file nobody can open again (its
                // data directory removed): nothing of it is durable, and
                // nothing after it would be.
                let message = "audit journal segment was deleted (was the data directory \
                               removed?): records can no longer be kept; restart serve"
                    .to_owned();
                self.broken = Some(message.clone());
                Err(AuditError::Storage(message))
            }
            Ok(()) => {
                self.segment_len += frames.len() as u64;
                Ok(())
            }
            Err(error) => {
                let message = format!("audit journal write failed: {error}");
                // Cutting back drops the preallocated tail too: what follows
                // is appended.
                self.preallocated = false;
                if let Err(undo) = self.segment.set_len(self.segment_len).and_then(|()| {
                    self.segment
                        .seek(io::SeekFrom::Start(self.segment_len))
                        .map(drop)
                }) {
                    self.broken = Some(format!("{message}; cutting it back failed: {undo}"));
                }
                Err(AuditError::Storage(message))
            }
        }
    }

    /// Drops the segments whose entries are all indexed (`indexed` is the
    /// store's last indexed sequence number), starts a new segment when the
    /// current one is full (or is a plain appended one and a preallocated
    /// spare is ready), and starts preallocating the next one when due.
    pub(crate) fn maintain(&mut self, indexed: u64) -> Result<(), AuditError> {
        if self.broken.is_none() {
            self.spare.collect();
            let spare_ready = matches!(self.spare, Spare::Ready(_));
            let plain = !self.preallocated && self.segment_len > 0;
            if self.segment_len >= SEGMENT_BYTES || (spare_ready && plain) {
                self.roll_over()?;
            }
            if matches!(self.spare, Spare::None) && self.segment_len >= PREPARE_SPARE_AFTER {
                self.spare = Spare::start(self.dir.join(SPARE_FILE));
            }
        }
        // The oldest sealed segment's entries end where the next one starts.
        if let Some(&oldest) = self.sealed.first() {
            let next = self.sealed.get(1).copied().unwrap_or(self.current_first);
            if next.saturating_sub(1) <= indexed {
                // Never the newest segment, which is the current one.
                remove_segments(&self.dir, indexed)?;
                self.sealed
                    .retain(|first| *first != oldest && segment_path(&self.dir, *first).exists());
            }
        }
        Ok(())
    }

    /// Seals the current segment (which holds entries) and makes the next
    /// record's segment current: the preallocated spare when it is ready, a
    /// new empty segment otherwise.
    fn roll_over(&mut self) -> Result<(), AuditError> {
        let first = self.next_seq;
        let (segment, preallocated) = match std::mem::replace(&mut self.spare, Spare::None) {
            Spare::Ready(file) => (install_spare(&self.dir, file, first)?, true),
            // A full segment and no spare ready: appended, as before them.
            // One still being made is left to finish; a failed one is
            // tried again once the new segment is busy.
            preparing @ Spare::Preparing(_) => {
                self.spare = preparing;
                (new_segment(&self.dir, first)?, false)
            }
            Spare::None | Spare::Failed => (new_segment(&self.dir, first)?, false),
        };
        self.sealed.push(self.current_first);
        self.segment = segment;
        self.segment_len = 0;
        self.preallocated = preallocated;
        self.current_first = first;
        Ok(())
    }
}

/// Where the next segment stands.
enum Spare {
    /// Not wanted yet.
    None,
    /// Being zero-filled by a helper thread.
    Preparing(JoinHandle<io::Result<File>>),
    /// Zero-filled and synced, positioned at its start.
    Ready(File),
    /// Making it failed: not tried again before the next roll-over.
    Failed,
}

impl Spare {
    /// Starts zero-filling `path` on a helper thread.
    fn start(path: PathBuf) -> Self {
        let spawned = std::thread::Builder::new()
            .name("audit-journal-spare".into())
            .spawn(move || zero_filled(&path, SEGMENT_BYTES));
        match spawned {
            Ok(helper) => Self::Preparing(helper),
            Err(error) => {
                tracing::warn!(%error, "cannot preallocate an audit journal segment");
                Self::Failed
            }
        }
    }

    /// Takes the helper thread's result once it has finished.
    fn collect(&mut self) {
        if !matches!(self, Self::Preparing(helper) if helper.is_finished()) {
            return;
        }
        if let Self::Preparing(helper) = std::mem::replace(self, Self::None) {
            *self = Self::joined(helper);
        }
    }

    /// What a finished helper thread leaves: its file, or a failure.
    fn joined(helper: JoinHandle<io::Result<File>>) -> Self {
        match helper.join() {
            Ok(Ok(file)) => Self::Ready(file),
            Ok(Err(error)) => {
                tracing::warn!(%error, "cannot preallocate an audit journal segment");
                Self::Failed
            }
            Err(_) => {
                tracing::warn!("the audit journal's preallocating thread panicked");
                Self::Failed
            }
        }
    }
}

fn segment_path(journal: &Path, first: u64) -> PathBuf {
    journal.join(format!("{first:020}{SEGMENT_SUFFIX}"))
}

fn remove_if_present(path: &Path) -> Result<(), AuditError> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(error) => Err(io_error(path, error)),
    }
}

/// Makes `journal`'s entry names durable.
/// Whether `segment` no longer has a name in the filesystem (its link count
/// is 0): what `rm -rf` of the data directory leaves an open file. One
/// `fstat` per synced batch.
fn segment_deleted(segment: &File) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        segment
            .metadata()
            .is_ok_and(|metadata| metadata.nlink() == 0)
    }
    #[cfg(not(unix))]
    {
        let _ = segment;
        false
    }
}

fn sync_dir(journal: &Path) -> Result<(), AuditError> {
    File::open(journal)
        .and_then(|dir| dir.sync_all())
        .map_err(|error| io_error(journal, error))
}

/// Creates the segment whose first entry is `first`, and makes its name
/// durable (syncs the directory). A segment whose name may not be durable is
/// removed: entries are written to the current one meanwhile, and a stray
/// newer segment would mark them as indexed too early.
fn new_segment(journal: &Path, first: u64) -> Result<File, AuditError> {
    let path = segment_path(journal, first);
    let file = create_private_file(&path).map_err(|error| io_error(&path, error))?;
    if let Err(error) = sync_dir(journal) {
        remove_if_present(&path)?;
        return Err(error);
    }
    Ok(file)
}

/// Renames the zero-filled `spare` to the segment whose first entry is
/// `first` and makes the name durable; removed again if it may not be.
fn install_spare(journal: &Path, spare: File, first: u64) -> Result<File, AuditError> {
    let path = segment_path(journal, first);
    let from = journal.join(SPARE_FILE);
    if let Err(error) = fs::rename(&from, &path) {
        // Nothing moved: the spare is dropped, the next one made anew.
        remove_if_present(&from)?;
        return Err(io_error(&from, error));
    }
    if let Err(error) = sync_dir(journal) {
        remove_if_present(&path)?;
        return Err(error);
    }
    Ok(spare)
}

/// Creates `path` (0600, replacing a leftover), writes `len` zero bytes to
/// it, syncs it and returns it positioned at its start.
fn zero_filled(path: &Path, len: u64) -> io::Result<File> {
    let _ = fs::remove_file(path);
    let mut file = create_private_file(path)?;
    let zeros = vec![0; 1 << 20];
    let mut left = len;
    while left > 0 {
        let chunk = left.min(zeros.len() as u64) as usize;
        file.write_all(&zeros[..chunk])?;
        left -= chunk as u64;
    }
    file.sync_all()?;
    file.rewind()?;
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(seq: u64, sample: Option<&[u8]>) -> Vec<u8> {
        let mut out = Vec::new();
        encode(seq, 1_000 + seq, br#"{"kind":"request"}"#, sample, &mut out);
        out
    }

    #[test]
    fn frames_round_trip_with_and_without_a_sample() {
        let mut bytes = frame(1, Some(b"sealed sample"));
        bytes.extend(frame(2, None));
        bytes.extend(frame(3, Some(b"")));
        let (frames, tail) = decode_all(&bytes, 1);
        assert_eq!(tail, Tail::Clean);
        assert_eq!(frames.len(), 3);
        assert_eq!(frames[0].seq, 1);
        assert_eq!(frames[0].at_ms, 1_001);
        assert_eq!(frames[0].sample.as_deref(), Some(&b"sealed sample"[..]));
        assert_eq!(frames[1].sample, None);
        assert_eq!(frames[2].sample.as_deref(), Some(&b""[..]));
        assert_eq!(frames[1].entry, br#"{"kind":"request"}"#);
    }

    #[test]
    fn a_cut_or_damaged_last_frame_ends_the_read_at_its_start() {
        let good = frame(1, None);
        let second = frame(2, Some(b"x"));
        for cut in 1..second.len() {
            let mut bytes = good.clone();
            bytes.extend_from_slice(&second[..cut]);
            let (frames, tail) = decode_all(&bytes, 1);
            assert_eq!(frames.len(), 1, "cut at {cut}");
            assert_eq!(tail, Tail::Torn(good.len()), "cut at {cut}");
        }
        for flip in 0..second.len() {
            let mut bytes = good.clone();
            let mut damaged = second.clone();
            damaged[flip] ^= 0x40;
            bytes.extend_from_slice(&damaged);
            let (frames, tail) = decode_all(&bytes, 1);
            assert_eq!(frames.len(), 1, "bit flipped in byte {flip}");
            assert_eq!(tail, Tail::Torn(good.len()), "bit flipped in byte {flip}");
        }
    }

    #[test]
    fn damage_before_a_newer_segment_is_an_error_not_a_silent_stop() {
        let dir = tempfile::tempdir().unwrap();
        let mut first = frame(1, None);
        first.extend_from_slice(&frame(2, None)[..5]);
        fs::write(segment_path(dir.path(), 1), &first).unwrap();
        fs::write(segment_path(dir.path(), 3), frame(3, None)).unwrap();
        let error = read_journal(dir.path()).unwrap_err();
        assert!(matches!(error, AuditError::Corrupt(_)), "{error}");
        // The same cut in the newest segment is a crash's torn write.
        fs::remove_file(segment_path(dir.path(), 3)).unwrap();
        assert_eq!(read_journal(dir.path()).unwrap().len(), 1);
    }

    #[test]
    fn damage_with_intact_records_after_it_is_an_error_wherever_it_is() {
        let frames: Vec<Vec<u8>> = (1..=6).map(|seq| frame(seq, None)).collect();
        let starts: Vec<usize> = frames
            .iter()
            .scan(0, |at, frame| {
                let start = *at;
                *at += frame.len();
                Some(start)
            })
            .collect();
        let bytes = frames.concat();
        let dir = tempfile::tempdir().unwrap();
        // A byte flipped in the first frame, in the third, in the last but one.
        for (damaged, next) in [(0, 2), (2, 4), (4, 6)] {
            for offset in [0, 4, 20, frames[damaged].len() - 1] {
                let mut flipped = bytes.clone();
                flipped[starts[damaged] + offset] ^= 0x40;
                let (read, tail) = decode_all(&flipped, 1);
                assert_eq!(read.len(), damaged, "frame {damaged}, byte {offset}");
                assert_eq!(
                    tail,
                    Tail::Damaged {
                        at: starts[damaged],
                        next
                    },
                    "frame {damaged}, byte {offset}"
                );
                // In the newest segment too, and the segment stays as it was.
                fs::write(segment_path(dir.path(), 1), &flipped).unwrap();
                let error = read_journal(dir.path()).unwrap_err();
                assert!(
                    matches!(&error, AuditError::Corrupt(message)
                        if message.contains(&format!("truncate -s {}", starts[damaged]))),
                    "{error}"
                );
                assert_eq!(fs::read(segment_path(dir.path(), 1)).unwrap(), flipped);
            }
        }
        // The last frame damaged has nothing after it: a torn write.
        let mut flipped = bytes.clone();
        flipped[starts[5] + 30] ^= 0x40;
        assert_eq!(
            decode_all(&flipped, 1),
            (decode_all(&bytes[..starts[5]], 1).0, Tail::Torn(starts[5]))
        );
    }

    #[test]
    fn zeros_to_the_end_are_unused_space_not_damage() {
        let mut bytes = frame(1, None);
        bytes.extend(frame(2, Some(b"sample")));
        let written = bytes.len();
        bytes.resize(written + 4096, 0);
        let (frames, tail) = decode_all(&bytes, 1);
        assert_eq!((frames.len(), tail), (2, Tail::Clean));
        // A preallocated segment sealed with its tail unused, then a newer one.
        let dir = tempfile::tempdir().unwrap();
        fs::write(segment_path(dir.path(), 1), &bytes).unwrap();
        let mut newer = frame(3, None);
        newer.resize(8192, 0);
        fs::write(segment_path(dir.path(), 3), &newer).unwrap();
        let seqs: Vec<u64> = read_journal(dir.path())
            .unwrap()
            .iter()
            .map(|f| f.seq)
            .collect();
        assert_eq!(seqs, [1, 2, 3]);
        // Anything but zeros after the frames is still a torn frame.
        bytes[written + 4000] = 1;
        assert_eq!(decode_all(&bytes, 1).1, Tail::Torn(written));
        fs::write(segment_path(dir.path(), 1), &bytes).unwrap();
        assert!(matches!(
            read_journal(dir.path()),
            Err(AuditError::Corrupt(_))
        ));
    }

    #[test]
    fn only_segments_wholly_indexed_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        for first in [1, 10, 20] {
            fs::write(segment_path(dir.path(), first), b"").unwrap();
        }
        remove_segments(dir.path(), 15).unwrap();
        // 1..=9 is indexed; 10..=19 is not wholly; the newest is kept.
        assert_eq!(
            segments(dir.path()).unwrap(),
            vec![segment_path(dir.path(), 10), segment_path(dir.path(), 20)]
        );
        remove_segments(dir.path(), u64::MAX).unwrap();
        assert!(segments(dir.path()).unwrap().is_empty());
    }
}
