//! `canarygate audit ...`: read, verify, export, review and prune the log.
//!
//! The store, its chain and its samples belong to the `canarygate-audit`
//! crate ([`Archive`]); this file parses the arguments and prints.

use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use canarygate_audit::time::{BadTime, format_rfc3339, now_ms, parse_time};
use canarygate_audit::{
    Archive, AuditError, Entry, Pruned, Record, RecordId, ReviewVerdict, Sample, SampleKey,
    Snapshot, TopicScore, catch_damage,
};
use clap::{Args, Subcommand};

pub const DEFAULT_KEY_ENV: &str = "CANARYGATE_AUDIT_KEY";

/// Arguments of `canarygate audit`.
#[derive(Debug, Args)]
pub struct AuditArgs {
    /// Data directory of the server (holds canarygate.redb). `export` and
    /// `verify` take it several times: one directory per instance.
    #[arg(long, global = true, value_name = "DIR", env = "CANARYGATE_DATA")]
    pub data: Vec<PathBuf>,
    /// Environment variable holding the sample key, to read encrypted samples.
    #[arg(long, global = true, value_name = "VAR", default_value = DEFAULT_KEY_ENV)]
    pub key_env: String,
    #[command(subcommand)]
    pub command: AuditCommand,
}

/// One `canarygate audit` subcommand.
#[derive(Debug, Subcommand)]
pub enum AuditCommand {
    /// Print the last records, one line each.
    Tail {
        /// How many records.
        #[arg(short = 'n', default_value_t = 20)]
        n: usize,
        /// Keep printing new records as they are written.
        #[arg(long)]
        follow: bool,
    },
    /// Print one record in full, with its sample and review.
    Show {
        /// Record id.
        id: RecordId,
    },
    /// Counts by verdict, check, provider and route; latency percentiles.
    Stats {
        /// Only records written at or after this time (RFC 3339, or 24h, 7d, ...).
        #[arg(long)]
        since: Option<String>,
    },
    /// Recompute the hash chain; fails naming the first bad record. With
    /// several --data, checks each chain.
    Verify,
    /// Write records as JSON Lines to standard output. With several --data
    /// (one per instance), their records merged in time order.
    Export {
        /// Only records written at or after this time.
        #[arg(long)]
        since: Option<String>,
        /// Only records written before this time.
        #[arg(long)]
        until: Option<String>,
    },
    /// Review sampled requests: interactively, or one with --mark.
    SpotCheck {
        /// Record a review without prompting: `--mark ID ok|bad`.
        #[arg(long, num_args = 2, value_names = ["ID", "VERDICT"])]
        mark: Option<Vec<String>>,
        /// Note stored with a --mark review.
        #[arg(long, requires = "mark")]
        note: Option<String>,
    },
    /// Serve the review page: the records, their samples and the review
    /// form in a browser (admin token in $CANARYGATE_ADMIN_TOKEN).
    Ui {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:8090")]
        listen: SocketAddr,
    },
    /// Remove records written before a time, leaving a checkpoint record.
    Prune {
        /// Remove records written before this time.
        #[arg(long)]
        before: String,
    },
}

/// Runs an `audit` command on standard input and output. A store damaged
/// behind redb's back is an error, never a crash ([`catch_damage`]).
pub fn run(args: AuditArgs) -> anyhow::Result<()> {
    if let AuditCommand::Ui { listen } = &args.command {
        let [dir] = args.data.as_slice() else {
            return Err(AuditError::InvalidArgument(
                "`audit ui` reads one --data DIR (or CANARYGATE_DATA)".into(),
            )
            .into());
        };
        return super::review::run(dir, *listen, &args.key_env);
    }
    Ok(run_terminal(args)?)
}

/// Runs the `audit` commands that answer on the terminal.
fn run_terminal(args: AuditArgs) -> Result<(), AuditError> {
    let stdin = std::io::stdin();
    let stdout = std::io::stdout();
    catch_damage(|| run_with(args, &mut stdin.lock(), &mut stdout.lock()))
}

/// Runs an `audit` command with the given input and output.
fn run_with(
    args: AuditArgs,
    input: &mut dyn BufRead,
    out: &mut dyn Write,
) -> Result<(), AuditError> {
    let now = now_ms();
    let time = |text: &Option<String>| -> Result<Option<u64>, AuditError> {
        text.as_deref()
            .map(|text| parse_time(text, now).map_err(bad_time))
            .transpose()
    };
    let dir = match (args.data.as_slice(), &args.command) {
        ([], _) => {
            return Err(AuditError::InvalidArgument(
                "--data DIR is required (or set CANARYGATE_DATA)".into(),
            ));
        }
        ([_, _, ..], AuditCommand::Verify) => return verify_each(&args.data, out),
        ([_, _, ..], AuditCommand::Export { since, until }) => {
            return export_merged(
                &args.data,
                time(since)?.unwrap_or(0),
                time(until)?.unwrap_or(u64::MAX),
                out,
            );
        }
        ([_, _, ..], _) => {
            return Err(AuditError::InvalidArgument(
                "several --data are for `export` and `verify`; this command reads one".into(),
            ));
        }
        ([dir], _) => dir.as_path(),
    };
    let key_env = args.key_env.as_str();
    match &args.command {
        AuditCommand::Tail { n, follow } => tail(dir, *n, *follow, out),
        AuditCommand::Show { id } => show(dir, *id, key_env, out),
        AuditCommand::Stats { since } => stats(dir, time(since)?.unwrap_or(0), out),
        AuditCommand::Verify => {
            let report = Archive::open_read_only(dir)?.verify()?;
            let range = report.range.map_or_else(
                || "no records".to_owned(),
                |(a, b)| format!("records {a}..={b}"),
            );
            line(
                out,
                format_args!(
                    "ok: {} records verified ({range}); head hash {}",
                    report.records,
                    hex::encode(report.head_hash)
                ),
            )
        }
        AuditCommand::Export { since, until } => export(
            dir,
            time(since)?.unwrap_or(0),
            time(until)?.unwrap_or(u64::MAX),
            out,
        ),
        AuditCommand::SpotCheck {
            mark: Some(mark),
            note,
        } => {
            let id = mark[0].parse::<RecordId>().map_err(|_| {
                AuditError::InvalidArgument(format!("--mark: `{}` is not a record id", mark[0]))
            })?;
            let verdict = match mark[1].as_str() {
                "ok" => ReviewVerdict::Ok,
                "bad" => ReviewVerdict::Bad,
                other => {
                    return Err(AuditError::InvalidArgument(format!(
                        "--mark: verdict `{other}` must be `ok` or `bad`"
                    )));
                }
            };
            let review = Archive::open_writable(dir)?.review(id, verdict, note.clone())?;
            line(
                out,
                format_args!("record {id} marked {}: review record {review}", mark[1]),
            )
        }
        AuditCommand::SpotCheck { mark: None, .. } => spot_check(dir, key_env, input, out),
        AuditCommand::Ui { .. } => Err(AuditError::InvalidArgument(
            "`audit ui` is served by `run`".into(),
        )),
        AuditCommand::Prune { before } => {
            let before = parse_time(before, now).map_err(bad_time)?;
            match Archive::open_writable(dir)?.prune(before)? {
                Pruned {
                    removed,
                    checkpoint: Some(checkpoint),
                } => line(
                    out,
                    format_args!(
                        "pruned {removed} records written before {}; checkpoint record {checkpoint}",
                        format_rfc3339(before)
                    ),
                ),
                Pruned { .. } => line(
                    out,
                    format_args!("nothing written before {}", format_rfc3339(before)),
                ),
            }
        }
    }
}

fn bad_time(error: BadTime) -> AuditError {
    AuditError::InvalidArgument(error.to_string())
}

fn line(out: &mut dyn Write, text: std::fmt::Arguments<'_>) -> Result<(), AuditError> {
    writeln!(out, "{text}").map_err(|error| AuditError::Io(format!("cannot write output: {error}")))
}

fn summary(record: &Record) -> String {
    let time = format_rfc3339(record.recorded_at_ms);
    match &record.entry {
        Entry::Request(request) => {
            let r = &request.record;
            format!(
                "#{} {time} {} {}/{} {} verdict={} action={} outcome={} total={}ms{}",
                record.id,
                r.request_id,
                r.provider,
                r.model,
                name(&r.route),
                name(&r.verdict),
                name(&r.action),
                name(&r.outcome),
                r.latency.total_ms,
                if request.sample.is_some() {
                    " [sampled]"
                } else {
                    ""
                }
            )
        }
        Entry::Review(review) => format!(
            "#{} {time} review of #{}: {}{}",
            record.id,
            review.reviewed_id,
            name(&review.verdict),
            review
                .note
                .as_deref()
                .map(|n| format!(" ({n})"))
                .unwrap_or_default()
        ),
        Entry::Topic(topic) => format!(
            "#{} {time} topic of #{}: {}{}",
            record.id,
            topic.scored_id,
            topic_summary(&topic.score),
            if topic.sample.is_some() {
                " [sampled]"
            } else {
                ""
            }
        ),
        Entry::Checkpoint(point) => format!(
            "#{} {time} checkpoint: {} records written before {} pruned; chain starts at #{}",
            record.id,
            point.pruned,
            format_rfc3339(point.before_ms),
            point.first_kept_id
        ),
    }
}

/// `similarity=0.6421 (min 0.10)`, `low`, or why it was not scored.
fn topic_summary(score: &TopicScore) -> String {
    match (score.similarity, &score.skipped) {
        (Some(similarity), _) => format!(
            "similarity={similarity:.4} (min {:.2}, {}){}",
            score.min_similarity,
            score.model,
            if score.low() { " LOW" } else { "" }
        ),
        (None, Some(why)) => format!("not scored: {why}"),
        (None, None) => "not scored".to_owned(),
    }
}

/// The serde name of a unit enum value (`pass`, `upstream`, ...).
fn name<T: serde::Serialize>(value: &T) -> String {
    match serde_json::to_value(value) {
        Ok(serde_json::Value::String(text)) => text,
        other => format!("{other:?}"),
    }
}

fn tail(dir: &Path, n: usize, follow: bool, out: &mut dyn Write) -> Result<(), AuditError> {
    let archive = Archive::open_read_only(dir)?;
    let mut next = 0;
    for stored in archive.snapshot()?.last(n)? {
        next = stored.id() + 1;
        line(out, format_args!("{}", summary(&stored.record)))?;
    }
    if !follow {
        return Ok(());
    }
    loop {
        out.flush()
            .map_err(|error| AuditError::Io(format!("cannot write output: {error}")))?;
        std::thread::sleep(Duration::from_millis(200));
        for stored in archive.snapshot()?.from_id(next, 1024)? {
            next = stored.id() + 1;
            line(out, format_args!("{}", summary(&stored.record)))?;
        }
    }
}

/// The sample of record `id`, decrypted with the key in `$key_env` when set.
fn read_sample(
    snapshot: &Snapshot,
    id: RecordId,
    request_id: &str,
    key_env: &str,
) -> Result<Option<Sample>, AuditError> {
    let key = SampleKey::from_env(key_env)?;
    snapshot
        .request_sample(id, request_id, key.as_ref())
        .map_err(|error| match error {
            AuditError::Key(message) => {
                AuditError::Key(format!("record {id}: {message} (${key_env})"))
            }
            other => other,
        })
}

fn show(dir: &Path, id: RecordId, key_env: &str, out: &mut dyn Write) -> Result<(), AuditError> {
    let snapshot = Archive::open_read_only(dir)?.snapshot()?;
    let stored = snapshot
        .get(id)?
        .ok_or_else(|| AuditError::NotFound(format!("no record {id}")))?;
    let pretty: serde_json::Value = serde_json::from_str(&stored.export_line()?)
        .map_err(|error| AuditError::Corrupt(format!("record {id}: {error}")))?;
    line(
        out,
        format_args!(
            "{}",
            serde_json::to_string_pretty(&pretty).unwrap_or_default()
        ),
    )?;
    if let Entry::Request(request) = &stored.record.entry {
        match read_sample(&snapshot, id, &request.record.request_id, key_env) {
            Ok(Some(sample)) => print_sample(&sample, out)?,
            Ok(None) => {}
            Err(AuditError::Key(message)) => line(out, format_args!("--- sample: {message}"))?,
            Err(error) => return Err(error),
        }
        if let Some(review) = snapshot.review_of(id)? {
            line(out, format_args!("--- reviewed in record {review}"))?;
        }
        if let Some((score, Some(topic_id))) = snapshot.topic_of(id)? {
            line(
                out,
                format_args!("--- topic (record {topic_id}): {}", topic_summary(&score)),
            )?;
        }
    }
    Ok(())
}

/// A sample's texts: the request, what the client received, and what the
/// provider sent when that differs (a failed verdict's evidence).
fn print_sample(sample: &Sample, out: &mut dyn Write) -> Result<(), AuditError> {
    line(
        out,
        format_args!("--- request text ---\n{}", sample.request_text),
    )?;
    line(
        out,
        format_args!("--- response text ---\n{}", sample.response_text),
    )?;
    if let Some(sent) = &sample.provider_text {
        line(
            out,
            format_args!("--- provider text (as the provider sent it) ---\n{sent}"),
        )?;
    }
    Ok(())
}

fn export(dir: &Path, since: u64, until: u64, out: &mut dyn Write) -> Result<(), AuditError> {
    let snapshot = Archive::open_read_only(dir)?.snapshot()?;
    snapshot.for_each(|stored| {
        if (since..until).contains(&stored.record.recorded_at_ms) {
            line(out, format_args!("{}", stored.export_line()?))?;
        }
        Ok(())
    })
}

/// Checks the chain of each directory; fails after all were checked when
/// any is broken, naming it.
fn verify_each(dirs: &[PathBuf], out: &mut dyn Write) -> Result<(), AuditError> {
    let mut broken = Vec::new();
    for dir in dirs {
        match Archive::open_read_only(dir).and_then(|archive| archive.verify()) {
            Ok(report) => line(
                out,
                format_args!(
                    "ok: {}: {} records verified; head hash {}",
                    dir.display(),
                    report.records,
                    hex::encode(report.head_hash)
                ),
            )?,
            Err(error) => {
                line(out, format_args!("FAILED: {}: {error}", dir.display()))?;
                broken.push(dir.display().to_string());
            }
        }
    }
    if broken.is_empty() {
        Ok(())
    } else {
        Err(AuditError::InvalidArgument(format!(
            "{} of {} chains do not verify: {}",
            broken.len(),
            dirs.len(),
            broken.join(", ")
        )))
    }
}

/// The records of every directory written in `since..until`, as one JSON
/// Lines stream in the order they were written (ties: directory order,
/// then id). Each directory's records are read whole first, so memory grows
/// with the range exported.
fn export_merged(
    dirs: &[PathBuf],
    since: u64,
    until: u64,
    out: &mut dyn Write,
) -> Result<(), AuditError> {
    let mut lines: Vec<(u64, usize, RecordId, String)> = Vec::new();
    for (index, dir) in dirs.iter().enumerate() {
        let snapshot = Archive::open_read_only(dir)?.snapshot()?;
        snapshot.for_each(|stored| {
            let at = stored.record.recorded_at_ms;
            if (since..until).contains(&at) {
                lines.push((at, index, stored.record.id, stored.export_line()?));
            }
            Ok(())
        })?;
    }
    lines.sort_unstable_by_key(|(at, index, id, _)| (*at, *index, *id));
    for (_, _, _, text) in lines {
        line(out, format_args!("{text}"))?;
    }
    Ok(())
}

fn percentiles(mut values: Vec<u64>) -> String {
    if values.is_empty() {
        return "n/a".into();
    }
    values.sort_unstable();
    let at = |q: f64| values[((values.len() - 1) as f64 * q).round() as usize];
    format!(
        "p50 {}ms  p90 {}ms  p99 {}ms  max {}ms  (n={})",
        at(0.5),
        at(0.9),
        at(0.99),
        values[values.len() - 1],
        values.len()
    )
}

fn stats(dir: &Path, since: u64, out: &mut dyn Write) -> Result<(), AuditError> {
    let snapshot = Archive::open_read_only(dir)?.snapshot()?;
    let mut groups: BTreeMap<&str, BTreeMap<String, u64>> = BTreeMap::new();
    let mut checks: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
    let (mut total, mut ttfb, mut overhead) = (Vec::new(), Vec::new(), Vec::new());
    let (mut requests, mut sampled) = (0u64, 0u64);
    snapshot.for_each(|stored| {
        let record = stored.record;
        if record.recorded_at_ms < since {
            return Ok(());
        }
        let mut count = |group: &'static str, key: String| {
            *groups.entry(group).or_default().entry(key).or_default() += 1;
        };
        match &record.entry {
            Entry::Request(request) => {
                let r = &request.record;
                requests += 1;
                sampled += u64::from(request.sample.is_some());
                count("verdict", name(&r.verdict));
                count("action", name(&r.action));
                count("outcome", name(&r.outcome));
                count("provider", r.provider.clone());
                count("route", name(&r.route));
                for check in &r.checks {
                    *checks
                        .entry(check.name.clone())
                        .or_default()
                        .entry(name(&check.result))
                        .or_default() += 1;
                }
                total.push(r.latency.total_ms);
                ttfb.extend(r.latency.ttfb_ms);
                overhead.push(r.latency.overhead_ms);
            }
            Entry::Review(review) => count("review", name(&review.verdict)),
            Entry::Topic(topic) => {
                sampled += u64::from(topic.sample.is_some());
                count(
                    "topic",
                    match topic.score.similarity {
                        Some(_) if topic.score.low() => "low".to_owned(),
                        Some(_) => "fits".to_owned(),
                        None => "not_scored".to_owned(),
                    },
                );
            }
            Entry::Checkpoint(_) => {}
        }
        Ok(())
    })?;
    line(
        out,
        format_args!("requests: {requests} ({sampled} sampled)"),
    )?;
    let join = |map: &BTreeMap<String, u64>| {
        map.iter()
            .map(|(key, n)| format!("{key} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    for (group, counts) in &groups {
        line(out, format_args!("{group}: {}", join(counts)))?;
    }
    for (check, counts) in &checks {
        line(out, format_args!("check {check}: {}", join(counts)))?;
    }
    line(out, format_args!("latency total: {}", percentiles(total)))?;
    line(out, format_args!("latency ttfb: {}", percentiles(ttfb)))?;
    line(
        out,
        format_args!("latency overhead: {}", percentiles(overhead)),
    )
}

fn prompt(
    input: &mut dyn BufRead,
    out: &mut dyn Write,
    question: &str,
) -> Result<Option<String>, AuditError> {
    write!(out, "{question}")
        .and_then(|()| out.flush())
        .map_err(|error| AuditError::Io(format!("cannot write output: {error}")))?;
    let mut answer = String::new();
    let read = input
        .read_line(&mut answer)
        .map_err(|error| AuditError::Io(format!("cannot read input: {error}")))?;
    Ok((read > 0).then(|| answer.trim().to_owned()))
}

fn spot_check(
    dir: &Path,
    key_env: &str,
    input: &mut dyn BufRead,
    out: &mut dyn Write,
) -> Result<(), AuditError> {
    let archive = Archive::open_writable(dir)?;
    let pending: Vec<RecordId> = {
        let snapshot = archive.snapshot()?;
        let mut pending = Vec::new();
        for id in snapshot.review_queue()? {
            if snapshot.review_of(id)?.is_none() {
                pending.push(id);
            }
        }
        pending
    };
    let (mut reviewed, mut skipped) = (0, 0);
    'samples: for (index, id) in pending.iter().enumerate() {
        let snapshot = archive.snapshot()?;
        let Some(stored) = snapshot.get(*id)? else {
            continue;
        };
        let record = stored.record;
        let Entry::Request(request) = &record.entry else {
            continue;
        };
        let sample = read_sample(&snapshot, *id, &request.record.request_id, key_env)?
            .ok_or_else(|| AuditError::Corrupt(format!("record {id}: sample vanished")))?;
        line(
            out,
            format_args!("\n=== sample {} of {} ===", index + 1, pending.len()),
        )?;
        line(out, format_args!("{}", summary(&record)))?;
        for check in &request.record.checks {
            line(
                out,
                format_args!(
                    "  check {}: {} {}",
                    check.name,
                    name(&check.result),
                    check.evidence
                ),
            )?;
        }
        if let Some((score, _)) = snapshot.topic_of(*id)? {
            line(out, format_args!("  topic: {}", topic_summary(&score)))?;
        }
        print_sample(&sample, out)?;
        let verdict = loop {
            match prompt(input, out, "fits this session? [y/n/s] ")?.as_deref() {
                None => break 'samples,
                Some("y" | "Y") => break Some(ReviewVerdict::Ok),
                Some("n" | "N") => break Some(ReviewVerdict::Bad),
                Some("s" | "S") => break None,
                Some(_) => line(
                    out,
                    format_args!("answer y (fits), n (does not) or s (skip)"),
                )?,
            }
        };
        let Some(verdict) = verdict else {
            skipped += 1;
            continue;
        };
        let note = prompt(input, out, "note (enter for none): ")?;
        let review_id = archive.review(*id, verdict, note)?;
        line(out, format_args!("recorded as review record {review_id}"))?;
        reviewed += 1;
    }
    line(
        out,
        format_args!(
            "{reviewed} reviewed, {skipped} skipped, {} left",
            pending.len() - reviewed
        ),
    )
}
