//! Server-rendered SVG charts over the list's rows: verdicts per time
//! bucket (stacked), failed checks per time bucket (stacked), and the
//! distribution of the proxy's own time (`overhead_ms`).
//!
//! Every number is drawn as text next to its axis; labels that come from
//! data (check names) go through [`Page::text`].

use canarygate_audit::VerdictSummary;
use canarygate_audit::time::format_rfc3339;

use crate::data::Row;
use crate::filter::verdict_name;
use crate::html::Page;

const WIDTH: u64 = 760;
const HEIGHT: u64 = 260;
const LEFT: u64 = 56;
const RIGHT: u64 = 16;
const TOP: u64 = 16;
const BOTTOM: u64 = 48;

/// Most buckets on the time axis.
const MAX_BUCKETS: u64 = 48;

/// Bars of the overhead histogram (plus one for the tail).
const HISTOGRAM_BINS: u64 = 20;

/// Bucket spans to choose from, in ms, with their label.
const SPANS: [(u64, &str); 10] = [
    (1_000, "1 s"),
    (10_000, "10 s"),
    (60_000, "1 min"),
    (300_000, "5 min"),
    (900_000, "15 min"),
    (3_600_000, "1 h"),
    (21_600_000, "6 h"),
    (86_400_000, "1 day"),
    (604_800_000, "1 week"),
    (2_592_000_000, "30 days"),
];

/// Series colours, in order (verdicts use the first four).
const PALETTE: [&str; 8] = [
    "#2e7d32", "#c62828", "#9e9e9e", "#6d4c9f", "#ef6c00", "#1565c0", "#ad1457", "#00838f",
];

const VERDICTS: [VerdictSummary; 4] = [
    VerdictSummary::Pass,
    VerdictSummary::Fail,
    VerdictSummary::Unchecked,
    VerdictSummary::Unverifiable,
];

/// Time buckets covering `rows`: the first bucket's start, the span and its
/// label, and the count.
fn buckets(rows: &[Row]) -> Option<(u64, u64, &'static str, usize)> {
    let first = rows.iter().map(|row| row.recorded_at_ms).min()?;
    let last = rows.iter().map(|row| row.recorded_at_ms).max()?;
    let range = last - first + 1;
    let (span, label) = SPANS
        .iter()
        .copied()
        .find(|(span, _)| range.div_ceil(*span) <= MAX_BUCKETS)
        .unwrap_or(SPANS[SPANS.len() - 1]);
    let start = first - first % span;
    let count = ((last - start) / span + 1) as usize;
    Some((start, span, label, count))
}

/// Draws the three charts for `rows`.
pub fn render(page: &mut Page, rows: &[Row]) {
    let Some((start, span, span_label, count)) = buckets(rows) else {
        page.markup("<p class=\"empty\">No request records match: nothing to chart.</p>");
        return;
    };
    let bucket = |row: &Row| ((row.recorded_at_ms - start) / span) as usize;

    let mut verdicts = vec![vec![0u64; VERDICTS.len()]; count];
    for row in rows {
        let series = VERDICTS.iter().position(|v| *v == row.verdict).unwrap_or(0);
        verdicts[bucket(row)][series] += 1;
    }
    let names: Vec<String> = VERDICTS.iter().map(|v| verdict_name(*v).into()).collect();
    page.markup("<h2>Verdicts over time</h2>");
    stacked(page, &names, &verdicts, start, span, span_label, "records");

    let mut checks: Vec<String> = rows.iter().flat_map(|row| row.failed.clone()).collect();
    checks.sort();
    checks.dedup();
    page.markup("<h2>Failed checks over time</h2>");
    if checks.is_empty() {
        page.markup("<p class=\"empty\">No check failed in these records.</p>");
    } else {
        let shown = checks.len().min(PALETTE.len());
        let mut failed = vec![vec![0u64; shown]; count];
        for row in rows {
            for name in &row.failed {
                if let Some(series) = checks[..shown].iter().position(|c| c == name) {
                    failed[bucket(row)][series] += 1;
                }
            }
        }
        stacked(
            page,
            &checks[..shown],
            &failed,
            start,
            span,
            span_label,
            "failures",
        );
        if checks.len() > shown {
            page.markup("<p class=\"note\">Only the first ")
                .show(shown)
                .markup(" check names are drawn.</p>");
        }
    }

    page.markup("<h2>Time spent in the proxy (overhead_ms)</h2>");
    histogram(page, rows.iter().map(|row| row.overhead_ms).collect());
}

fn svg_open(page: &mut Page, label: &str) {
    page.markup("<svg xmlns=\"http://www.w3.org/2000/svg\" role=\"img\" viewBox=\"0 0 ")
        .show(WIDTH)
        .markup(" ")
        .show(HEIGHT)
        .markup("\" aria-label=\"")
        .text(label)
        .markup("\">");
}

/// The y axis from 0 to `max` with three labelled ticks, and its title.
fn y_axis(page: &mut Page, max: u64, title: &str) {
    let plot = HEIGHT - TOP - BOTTOM;
    for tick in [0, max.div_ceil(2), max] {
        let y = TOP + plot - plot * tick / max.max(1);
        page.markup("<line class=\"grid\" x1=\"")
            .show(LEFT)
            .markup("\" x2=\"")
            .show(WIDTH - RIGHT)
            .markup("\" y1=\"")
            .show(y)
            .markup("\" y2=\"")
            .show(y)
            .markup("\"/><text class=\"tick\" text-anchor=\"end\" x=\"")
            .show(LEFT - 6)
            .markup("\" y=\"")
            .show(y + 4)
            .markup("\">")
            .show(tick)
            .markup("</text>");
    }
    page.markup("<text class=\"axis\" transform=\"rotate(-90)\" text-anchor=\"middle\" x=\"-")
        .show(TOP + plot / 2)
        .markup("\" y=\"14\">")
        .text(title)
        .markup("</text>");
}

fn x_label(page: &mut Page, x: u64, text: &str, anchor: &'static str) {
    page.markup("<text class=\"tick\" text-anchor=\"")
        .markup(anchor)
        .markup("\" x=\"")
        .show(x)
        .markup("\" y=\"")
        .show(HEIGHT - BOTTOM + 16)
        .markup("\">")
        .text(text)
        .markup("</text>");
}

fn x_title(page: &mut Page, text: &str) {
    page.markup("<text class=\"axis\" text-anchor=\"middle\" x=\"")
        .show(LEFT + (WIDTH - LEFT - RIGHT) / 2)
        .markup("\" y=\"")
        .show(HEIGHT - 8)
        .markup("\">")
        .text(text)
        .markup("</text>");
}

/// A stacked bar chart: `counts[bucket][series]`.
fn stacked(
    page: &mut Page,
    series: &[String],
    counts: &[Vec<u64>],
    start: u64,
    span: u64,
    span_label: &str,
    unit: &str,
) {
    let max = counts
        .iter()
        .map(|bucket| bucket.iter().sum::<u64>())
        .max()
        .unwrap_or(0)
        .max(1);
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let bar = plot_w / counts.len() as u64;
    svg_open(page, &format!("{unit} per {span_label}, by series"));
    y_axis(page, max, &format!("{unit} per {span_label}"));
    for (index, bucket) in counts.iter().enumerate() {
        let x = LEFT + bar * index as u64;
        let mut base = TOP + plot_h;
        for (series_index, &n) in bucket.iter().enumerate() {
            if n == 0 {
                continue;
            }
            let h = (plot_h * n / max).max(1);
            base -= h;
            page.markup("<rect fill=\"")
                .markup(PALETTE[series_index % PALETTE.len()])
                .markup("\" x=\"")
                .show(x + 1)
                .markup("\" y=\"")
                .show(base)
                .markup("\" width=\"")
                .show(bar.saturating_sub(2).max(1))
                .markup("\" height=\"")
                .show(h)
                .markup("\"><title>")
                .text(&format!(
                    "{}: {n} {unit} from {}",
                    series[series_index],
                    format_rfc3339(start + span * index as u64)
                ))
                .markup("</title></rect>");
        }
    }
    let last = counts.len() as u64 - 1;
    x_label(page, LEFT, &short_time(start), "start");
    x_label(page, WIDTH - RIGHT, &short_time(start + span * last), "end");
    x_title(page, &format!("time (UTC), one bar per {span_label}"));
    page.markup("</svg><p class=\"legend\">");
    for (index, name) in series.iter().enumerate() {
        let total: u64 = counts.iter().map(|bucket| bucket[index]).sum();
        page.markup("<span class=\"key k")
            .show(index % PALETTE.len())
            .markup("\"></span>")
            .text(name)
            .markup(" ")
            .show(total)
            .markup(" ");
    }
    page.markup("</p>");
}

/// A histogram of `values` (ms): equal bins up to the 99th percentile, the
/// rest in a last bin.
fn histogram(page: &mut Page, mut values: Vec<u64>) {
    if values.is_empty() {
        page.markup("<p class=\"empty\">No records.</p>");
        return;
    }
    values.sort_unstable();
    let p50 = values[(values.len() - 1) / 2];
    let p99 = values[((values.len() - 1) as f64 * 0.99).round() as usize];
    let max_value = values[values.len() - 1];
    let width = (p99 + 1).div_ceil(HISTOGRAM_BINS).max(1);
    let mut bins = vec![0u64; HISTOGRAM_BINS as usize + 1];
    for value in &values {
        bins[((value / width) as usize).min(HISTOGRAM_BINS as usize)] += 1;
    }
    let tail = bins[HISTOGRAM_BINS as usize] > 0;
    if !tail {
        bins.pop();
    }
    let max = bins.iter().copied().max().unwrap_or(1).max(1);
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let bar = plot_w / bins.len() as u64;
    svg_open(page, "records by overhead_ms");
    y_axis(page, max, "records");
    for (index, &n) in bins.iter().enumerate() {
        if n == 0 {
            continue;
        }
        let low = width * index as u64;
        let range = if index as u64 == HISTOGRAM_BINS {
            format!("{low} ms and more")
        } else {
            format!("{low} to {} ms", low + width - 1)
        };
        let h = (plot_h * n / max).max(1);
        page.markup("<rect fill=\"#1565c0\" x=\"")
            .show(LEFT + bar * index as u64 + 1)
            .markup("\" y=\"")
            .show(TOP + plot_h - h)
            .markup("\" width=\"")
            .show(bar.saturating_sub(2).max(1))
            .markup("\" height=\"")
            .show(h)
            .markup("\"><title>")
            .text(&format!("{range}: {n} records"))
            .markup("</title></rect>");
    }
    x_label(page, LEFT, "0 ms", "start");
    let end = if tail {
        format!("{} ms +", width * HISTOGRAM_BINS)
    } else {
        format!("{} ms", width * bins.len() as u64)
    };
    x_label(page, WIDTH - RIGHT, &end, "end");
    x_title(page, &format!("overhead_ms, bins of {width} ms"));
    page.markup("</svg><p class=\"legend\">")
        .text(&format!(
            "n = {}, p50 {p50} ms, p99 {p99} ms, max {max_value} ms",
            values.len()
        ))
        .markup("</p>");
}

/// `2026-11-30 12:00` from unix ms.
fn short_time(ms: u64) -> String {
    let full = format_rfc3339(ms);
    full.get(..16).unwrap_or(&full).replace('T', " ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use canarygate_audit::{Action, Route};

    fn row(id: u64, at: u64, verdict: VerdictSummary, failed: &[&str], overhead: u64) -> Row {
        Row {
            id,
            recorded_at_ms: at,
            request_id: format!("r{id}"),
            session: "ab".into(),
            provider: "p".into(),
            model: "m".into(),
            endpoint: None,
            route: Route::Upstream,
            verdict,
            action: Action::Forward,
            failed: failed.iter().map(|s| (*s).to_owned()).collect(),
            sampled: false,
            topic: None,
            total_ms: 10,
            overhead_ms: overhead,
            review: None,
        }
    }

    #[test]
    fn buckets_fit_the_range() {
        let t = 1_780_000_000_000;
        let rows = [
            row(1, t, VerdictSummary::Pass, &[], 1),
            row(2, t + 3_600_000, VerdictSummary::Pass, &[], 1),
        ];
        let (start, span, label, count) = buckets(&rows).unwrap();
        assert_eq!((span, label), (300_000, "5 min"));
        assert!(start <= t && start % span == 0);
        assert_eq!(count, 13);
        assert!(buckets(&[]).is_none());
    }

    #[test]
    fn charts_label_counts_and_escape_names() {
        let t = 1_780_000_000_000;
        let rows = [
            row(1, t, VerdictSummary::Pass, &[], 2),
            row(2, t + 1000, VerdictSummary::Fail, &["<b>echo</b>"], 5),
            row(3, t + 2000, VerdictSummary::Fail, &["foreign_canary"], 900),
        ];
        let mut page = Page::new();
        render(&mut page, &rows);
        let html = page.finish();
        assert_eq!(html.matches("<svg").count(), 3, "{html}");
        assert!(html.contains("&lt;b&gt;echo&lt;/b&gt; 1"), "{html}");
        assert!(!html.contains("<b>"));
        assert!(html.contains("pass 1") && html.contains("fail 2"), "{html}");
        assert!(html.contains("p50 5 ms"), "{html}");
        assert!(html.contains("records per 1 s"), "{html}");
    }
}
