//! The pages, as HTML strings: the frame, the login form, the record list,
//! one record, the charts and the error page. Pure functions of what
//! [`crate::data`] read; every value goes through [`Page::text`].

use canarygate_audit::time::format_rfc3339;
use canarygate_audit::{Entry, Record, ReviewVerdict, TopicScore, VerdictSummary};
use canarygate_policies::verify::Status;

use crate::charts;
use crate::data::{Detail, Listing, Row};
use crate::filter::{Filter, Order, PAGE_SIZE, Reviewed, route_name, verdict_name};
use crate::html::{Page, url_encode};

/// Longest review note, in characters (the form's `maxlength`, checked
/// again when it is posted).
pub const MAX_NOTE_CHARS: usize = 4000;

/// The stylesheet, served at `/style.css` (the policy allows no inline style).
pub const STYLE: &str = "\
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#1d1d1f;background:#fafafa}
header{background:#263238;color:#fff;padding:8px 16px;display:flex;gap:16px;align-items:center}
header a{color:#fff}header form{margin-left:auto}
main{padding:12px 16px}
table{border-collapse:collapse;width:100%;background:#fff}
th,td{border-bottom:1px solid #ddd;padding:4px 6px;text-align:left;vertical-align:top}
th{background:#eceff1}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.v{padding:1px 6px;border-radius:3px;color:#fff}
.v-pass{background:#2e7d32}.v-fail{background:#c62828}.v-unchecked{background:#757575}.v-unverifiable{background:#6d4c9f}
.r-ok{color:#2e7d32}.r-bad{color:#c62828;font-weight:bold}
form.filters{display:flex;flex-wrap:wrap;gap:8px;align-items:end;margin-bottom:12px}
form.filters label{display:flex;flex-direction:column;font-size:12px}
.sides{display:grid;grid-template-columns:repeat(auto-fit,minmax(280px,1fr));gap:10px}
.sides pre,pre.evidence{white-space:pre-wrap;word-break:break-word;background:#fff;border:1px solid #ccc;padding:8px;max-height:480px;overflow:auto;margin:0}
.exposed{border:2px solid #c62828;background:#ffebee;padding:8px 12px;margin:10px 0}
.error{border:2px solid #c62828;background:#fff;padding:8px 12px}
.empty,.note{color:#555}.low{color:#c62828;font-weight:bold}
svg{background:#fff;border:1px solid #ddd;width:100%;max-width:760px;height:auto}
svg .grid{stroke:#e0e0e0}svg .tick{font-size:11px;fill:#333}svg .axis{font-size:12px;fill:#000}
.legend .key{display:inline-block;width:10px;height:10px;margin:0 4px 0 10px}
.k0{background:#2e7d32}.k1{background:#c62828}.k2{background:#9e9e9e}.k3{background:#6d4c9f}
.k4{background:#ef6c00}.k5{background:#1565c0}.k6{background:#ad1457}.k7{background:#00838f}
dl.fields{display:grid;grid-template-columns:max-content 1fr;gap:2px 12px}dl.fields dt{font-weight:bold}
dl.fields dd{margin:0;word-break:break-all}
";

/// The frame around every page; `csrf` is given on authenticated pages
/// (it adds the navigation and the logout form).
pub fn frame(title: &str, csrf: Option<&str>, body: Page) -> String {
    let mut page = Page::new();
    page.markup(
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <link rel=\"stylesheet\" href=\"/style.css\"><title>",
    )
    .text(title)
    .markup(" - canarygate review</title></head><body><header><strong>canarygate review</strong>");
    if let Some(csrf) = csrf {
        page.markup("<a href=\"/\">Records</a><a href=\"/?order=suspicious&amp;reviewed=no\">To review</a><a href=\"/charts\">Charts</a>")
            .markup("<form method=\"post\" action=\"/logout\"><input type=\"hidden\" name=\"csrf\" value=\"")
            .text(csrf)
            .markup("\"><button type=\"submit\">Log out</button></form>");
    }
    page.markup("</header><main>");
    let mut out = page.finish();
    out.push_str(&body.finish());
    out.push_str("</main></body></html>");
    out
}

/// The login form, with a message after a refused attempt.
pub fn login(message: Option<&str>) -> String {
    let mut body = Page::new();
    body.markup("<h1>Log in</h1>");
    if let Some(message) = message {
        body.markup("<p class=\"error\" id=\"login-error\">")
            .text(message)
            .markup("</p>");
    }
    body.markup(
        "<form method=\"post\" action=\"/login\"><label>Admin token \
         <input type=\"password\" name=\"token\" id=\"token\" autocomplete=\"current-password\" required>\
         </label> <button type=\"submit\" id=\"login\">Log in</button></form>\
         <p class=\"note\">The token is the value of the server's admin token variable \
         (CANARYGATE_ADMIN_TOKEN).</p>",
    );
    frame("Log in", None, body)
}

/// An error page: a heading and the reason.
pub fn error(title: &str, message: &str, csrf: Option<&str>) -> String {
    let mut body = Page::new();
    body.element("h1", title)
        .markup("<p class=\"error\" id=\"error\">")
        .text(message)
        .markup("</p><p><a href=\"/\">Back to the records</a></p>");
    frame(title, csrf, body)
}

fn verdict_badge(page: &mut Page, verdict: VerdictSummary) {
    let name = verdict_name(verdict);
    page.markup("<span class=\"v v-")
        .markup(name)
        .markup("\">")
        .markup(name)
        .markup("</span>");
}

fn review_name(verdict: ReviewVerdict) -> &'static str {
    match verdict {
        ReviewVerdict::Ok => "ok",
        ReviewVerdict::Bad => "bad",
    }
}

/// A `<select>` with an "any" option and `options`, `selected` marked.
fn select(
    page: &mut Page,
    name: &'static str,
    label: &'static str,
    options: &[&str],
    selected: Option<&str>,
) {
    page.markup("<label>")
        .markup(label)
        .markup("<select name=\"")
        .markup(name)
        .markup("\" id=\"f-")
        .markup(name)
        .markup("\"><option value=\"\">any</option>");
    for option in options {
        page.markup("<option value=\"").text(option).markup("\"");
        if selected == Some(*option) {
            page.markup(" selected");
        }
        page.markup(">").text(option).markup("</option>");
    }
    page.markup("</select></label>");
}

fn input(
    page: &mut Page,
    name: &'static str,
    label: &'static str,
    value: Option<&str>,
    hint: &'static str,
) {
    page.markup("<label>")
        .markup(label)
        .markup("<input name=\"")
        .markup(name)
        .markup("\" id=\"f-")
        .markup(name)
        .markup("\" placeholder=\"")
        .markup(hint)
        .markup("\" value=\"")
        .text(value.unwrap_or(""))
        .markup("\"></label>");
}

/// The filter form, targeting `action` (`/` or `/charts`).
fn filter_form(page: &mut Page, action: &'static str, filter: &Filter, listing: &Listing) {
    page.markup("<form class=\"filters\" method=\"get\" action=\"")
        .markup(action)
        .markup("\">");
    select(
        page,
        "verdict",
        "verdict",
        &["pass", "fail", "unchecked", "unverifiable"],
        filter.verdict.map(verdict_name),
    );
    let checks: Vec<&str> = listing.failed_checks.iter().map(String::as_str).collect();
    select(
        page,
        "check",
        "failed check",
        &checks,
        filter.check.as_deref(),
    );
    select(
        page,
        "route",
        "route",
        &["upstream", "local"],
        filter.route.map(route_name),
    );
    let endpoints: Vec<&str> = listing.endpoints.iter().map(String::as_str).collect();
    select(
        page,
        "endpoint",
        "endpoint",
        &endpoints,
        filter.endpoint.as_deref(),
    );
    input(
        page,
        "session",
        "session (hash prefix)",
        filter.session.as_deref(),
        "e.g. 3fa9",
    );
    input(page, "request", "request id", filter.request.as_deref(), "");
    input(
        page,
        "since",
        "since",
        filter.since.as_ref().map(|(_, t)| t.as_str()),
        "24h or 2026-11-30",
    );
    input(
        page,
        "until",
        "until",
        filter.until.as_ref().map(|(_, t)| t.as_str()),
        "RFC 3339",
    );
    select(
        page,
        "topic",
        "topic score",
        &["low"],
        filter.low_topic.then_some("low"),
    );
    select(
        page,
        "reviewed",
        "reviewed",
        &["yes", "no"],
        filter.reviewed.map(|r| match r {
            Reviewed::Yes => "yes",
            Reviewed::No => "no",
        }),
    );
    page.markup("<label>order<select name=\"order\" id=\"f-order\"><option value=\"newest\">newest first</option><option value=\"suspicious\"");
    if filter.order == Order::Suspicious {
        page.markup(" selected");
    }
    page.markup(">suspicious first</option></select></label>")
        .markup("<button type=\"submit\" id=\"apply\">Apply</button> <a href=\"")
        .markup(action)
        .markup("\">clear</a></form>");
}

/// The record list.
pub fn list(filter: &Filter, listing: &Listing, csrf: &str) -> String {
    let mut body = Page::new();
    body.markup("<h1>Records</h1>");
    filter_form(&mut body, "/", filter, listing);
    let total = listing.rows.len();
    let pages = total.div_ceil(PAGE_SIZE).max(1);
    let page_number = filter.page.min(pages);
    body.markup("<p id=\"count\">")
        .show(total)
        .markup(" of ")
        .show(listing.requests)
        .markup(" request records match; page ")
        .show(page_number)
        .markup(" of ")
        .show(pages)
        .markup(". <a href=\"/charts?")
        .text(&filter.query(1))
        .markup("\">Chart these</a></p>");
    if total == 0 {
        body.markup("<p class=\"empty\">No records match these filters.</p>");
    } else {
        body.markup(
            "<table id=\"records\"><thead><tr><th>#</th><th>written (UTC)</th><th>verdict</th>\
             <th>failed checks</th><th>action</th><th>route</th><th>endpoint</th><th>provider/model</th>\
             <th>session</th><th>topic</th><th>total ms</th><th>overhead ms</th><th>sample</th><th>review</th></tr></thead><tbody>",
        );
        let from = (page_number - 1) * PAGE_SIZE;
        for row in listing.rows.iter().skip(from).take(PAGE_SIZE) {
            list_row(&mut body, row);
        }
        body.markup("</tbody></table><p>");
        if page_number > 1 {
            body.link(&format!("/?{}", filter.query(page_number - 1)), "newer");
            body.markup(" ");
        }
        if page_number < pages {
            body.link(&format!("/?{}", filter.query(page_number + 1)), "older");
        }
        body.markup("</p>");
    }
    frame("Records", Some(csrf), body)
}

fn list_row(body: &mut Page, row: &Row) {
    body.markup("<tr class=\"record\" data-id=\"")
        .show(row.id)
        .markup("\"><td>")
        .link(&format!("/records/{}", row.id), &row.id.to_string())
        .markup("</td><td>")
        .text(&format_rfc3339(row.recorded_at_ms))
        .markup("</td><td>");
    verdict_badge(body, row.verdict);
    body.markup("</td><td>")
        .text(&row.failed.join(", "))
        .markup("</td><td>")
        .text(&name(&row.action))
        .markup("</td><td>")
        .markup(route_name(row.route))
        .markup("</td><td>")
        .text(row.endpoint.as_deref().unwrap_or(""))
        .markup("</td><td>")
        .text(&format!("{}/{}", row.provider, row.model))
        .markup("</td><td>")
        .link(
            &format!("/?session={}", url_encode(&row.session)),
            row.session.get(..8).unwrap_or(&row.session),
        )
        .markup("</td><td class=\"num\">");
    topic_cell(body, row.topic.as_ref());
    body.markup("</td><td class=\"num\">")
        .show(row.total_ms)
        .markup("</td><td class=\"num\">")
        .show(row.overhead_ms)
        .markup("</td><td>")
        .markup(if row.sampled { "kept" } else { "" })
        .markup("</td><td>");
    match row.review {
        Some(ReviewVerdict::Ok) => body.markup("<span class=\"r-ok\">ok</span>"),
        Some(ReviewVerdict::Bad) => body.markup("<span class=\"r-bad\">bad</span>"),
        None => body.markup(""),
    };
    body.markup("</td></tr>");
}

/// A topic score in a cell: the similarity, marked when low; why it was
/// skipped; nothing when unscored.
fn topic_cell(body: &mut Page, score: Option<&TopicScore>) {
    match score {
        Some(
            score @ TopicScore {
                similarity: Some(similarity),
                ..
            },
        ) => {
            if score.low() {
                body.markup("<span class=\"low\" title=\"below the threshold\">")
                    .text(&format!("{similarity:.4}"))
                    .markup(" low</span>");
            } else {
                body.text(&format!("{similarity:.4}"));
            }
        }
        Some(TopicScore {
            skipped: Some(why), ..
        }) => {
            body.markup("<span class=\"note\">skipped: ")
                .text(why)
                .markup("</span>");
        }
        _ => {}
    }
}

/// The topic score in words, for the record page.
fn topic_words(score: &TopicScore) -> String {
    match (score.similarity, &score.skipped) {
        (Some(similarity), _) => format!(
            "similarity {similarity:.4} against a threshold of {:.4}: {} (model {})",
            score.min_similarity,
            if score.low() {
                "LOW, the answer may not be about what was asked"
            } else {
                "fits"
            },
            score.model
        ),
        (None, Some(why)) => format!("not scored: {why} (model {})", score.model),
        (None, None) => format!("not scored (model {})", score.model),
    }
}

/// The serde name of a unit enum value (`forward`, `complete`, ...).
fn name<T: serde::Serialize>(value: &T) -> String {
    match serde_json::to_value(value) {
        Ok(serde_json::Value::String(text)) => text,
        other => format!("{other:?}"),
    }
}

/// The charts page.
pub fn charts(filter: &Filter, listing: &Listing, csrf: &str) -> String {
    let mut body = Page::new();
    body.markup("<h1>Charts</h1>");
    filter_form(&mut body, "/charts", filter, listing);
    body.markup("<p>")
        .show(listing.rows.len())
        .markup(" of ")
        .show(listing.requests)
        .markup(" request records. <a href=\"/?")
        .text(&filter.query(1))
        .markup("\">List these</a></p>");
    charts::render(&mut body, &listing.rows);
    frame("Charts", Some(csrf), body)
}

fn field(page: &mut Page, label: &'static str, value: &str) {
    page.markup("<dt>")
        .markup(label)
        .markup("</dt><dd>")
        .text(value)
        .markup("</dd>");
}

fn optional<T: std::fmt::Display>(value: Option<T>) -> String {
    value.map_or_else(|| "none".to_owned(), |value| value.to_string())
}

/// One request record: fields, checks, sample side by side, review.
pub fn record(detail: &Detail, csrf: &str) -> String {
    let record = &detail.record;
    let r = &detail.request.record;
    let mut body = Page::new();
    body.markup("<h1>Record ").show(record.id).markup(" ");
    verdict_badge(&mut body, r.verdict);
    body.markup("</h1>");

    exposed(&mut body, detail);
    body.markup("<p id=\"summary\">")
        .text(&format!(
            "{} at {}: {}/{} via {}, action {}, outcome {}, total {} ms.",
            r.request_id,
            format_rfc3339(record.recorded_at_ms),
            r.provider,
            r.model,
            r.endpoint.as_deref().unwrap_or("an unrecorded endpoint"),
            name(&r.action),
            name(&r.outcome),
            r.latency.total_ms
        ))
        .markup("</p>");
    body.markup("<p id=\"topic\"><strong>Topic:</strong> ");
    match &detail.topic {
        Some((score, topic_record)) => {
            if score.low() {
                body.markup("<span class=\"low\">");
            } else {
                body.markup("<span>");
            }
            body.text(&topic_words(score)).markup("</span>");
            if let Some(topic_id) = topic_record {
                body.markup(" (scored after delivery, in ")
                    .link(
                        &format!("/records/{topic_id}"),
                        &format!("record {topic_id}"),
                    )
                    .markup(")");
            }
        }
        None => {
            body.markup("not scored (no [topic] model, or not on the verified path)");
        }
    }
    body.markup("</p>");

    body.markup("<h2>Sample</h2>");
    match &detail.sample {
        Ok(Some(sample)) => {
            body.markup("<div class=\"sides\"><section><h3>What the client asked</h3><pre id=\"request-text\">")
                .text(&sample.request_text)
                .markup("</pre></section><section><h3>What the client received</h3><pre id=\"response-text\">")
                .text(&sample.response_text)
                .markup("</pre></section>");
            if let Some(sent) = &sample.provider_text {
                body.markup("<section><h3>What the provider sent</h3><pre id=\"provider-text\">")
                    .text(sent)
                    .markup("</pre></section>");
            }
            body.markup("</div>");
        }
        Ok(None) => {
            body.markup("<p class=\"empty\">Not sampled: no text was kept for this request.</p>");
        }
        Err(message) => {
            body.markup("<p class=\"error\">")
                .text(message)
                .markup("</p>");
        }
    }

    body.markup("<h2>Review</h2>");
    match &detail.review {
        Some((review_id, review)) => {
            body.markup("<p id=\"review\">Reviewed in ")
                .link(
                    &format!("/records/{review_id}"),
                    &format!("record {review_id}"),
                )
                .markup(": <span class=\"r-")
                .markup(review_name(review.verdict))
                .markup("\">")
                .markup(review_name(review.verdict))
                .markup("</span>");
            if let Some(note) = &review.note {
                body.markup(" - ").element("q", note);
            }
            body.markup("</p>");
        }
        None => {
            body.markup("<form method=\"post\" id=\"review-form\" action=\"/records/")
                .show(record.id)
                .markup("/review\"><input type=\"hidden\" name=\"csrf\" value=\"")
                .text(csrf)
                .markup(
                    "\"><p><label><input type=\"radio\" name=\"verdict\" value=\"ok\" id=\"verdict-ok\" required> \
                     ok: the answer fits this session</label><br><label><input type=\"radio\" name=\"verdict\" \
                     value=\"bad\" id=\"verdict-bad\"> bad: a leak or a wrong answer</label></p>\
                     <p><label>Note<br><textarea name=\"note\" id=\"note\" rows=\"3\" cols=\"60\" maxlength=\"",
                )
                .show(MAX_NOTE_CHARS)
                .markup("\"></textarea></label></p><p><button type=\"submit\" id=\"submit-review\">Record the review</button></p></form>")
                .markup("<p class=\"note\">A review is a chained audit record: it cannot be changed afterwards.</p>");
        }
    }
    body.markup("<h2>Checks</h2><table id=\"checks\"><thead><tr><th>check</th><th>result</th><th>reason</th><th>evidence</th></tr></thead><tbody>");
    for check in &r.checks {
        let evidence = check.evidence.value();
        let result = match check.result {
            Status::Pass => "pass",
            Status::Fail => "fail",
            Status::Skip => "skip",
        };
        body.markup("<tr><td>")
            .text(&check.name)
            .markup("</td><td><span class=\"v v-")
            .markup(match check.result {
                Status::Pass => "pass",
                Status::Fail => "fail",
                Status::Skip => "unchecked",
            })
            .markup("\">")
            .markup(result)
            .markup("</span></td><td>")
            .text(evidence["reason"].as_str().unwrap_or(""))
            .markup("</td><td><pre class=\"evidence\">")
            .text(&serde_json::to_string_pretty(&evidence["seen"]).unwrap_or_default())
            .markup("</pre></td></tr>");
    }
    body.markup("</tbody></table>");

    body.markup("<h2>Record</h2>");
    body.markup("<dl class=\"fields\">");
    field(&mut body, "request id", &r.request_id);
    field(&mut body, "written", &format_rfc3339(record.recorded_at_ms));
    field(&mut body, "started", &format_rfc3339(r.started_at_ms));
    body.markup("<dt>session</dt><dd>")
        .link(&format!("/?session={}", url_encode(&r.session)), &r.session)
        .markup("</dd>");
    field(
        &mut body,
        "credential (keyed hash)",
        r.credential.as_deref().unwrap_or("none"),
    );
    field(
        &mut body,
        "provider / model",
        &format!("{} / {}", r.provider, r.model),
    );
    field(
        &mut body,
        "endpoint",
        r.endpoint.as_deref().unwrap_or("not recorded"),
    );
    field(&mut body, "route", route_name(r.route));
    field(&mut body, "action", &name(&r.action));
    field(&mut body, "outcome", &name(&r.outcome));
    field(
        &mut body,
        "latency",
        &format!(
            "ttfb {} ms, total {} ms, overhead {} ms",
            optional(r.latency.ttfb_ms),
            r.latency.total_ms,
            r.latency.overhead_ms
        ),
    );
    field(
        &mut body,
        "prompt tokens",
        &format!(
            "ours {}, provider {}",
            optional(r.prompt_tokens_ours),
            optional(r.prompt_tokens_provider)
        ),
    );
    if let Some(tokens) = r.overhead_tokens {
        field(
            &mut body,
            "canarygate's tokens",
            &format!("prompt {}, completion {}", tokens.prompt, tokens.completion),
        );
    }
    field(
        &mut body,
        "bytes",
        &format!("in {}, out {}", r.bytes_in, r.bytes_out),
    );
    field(
        &mut body,
        "provider request id",
        r.provider_request_id.as_deref().unwrap_or("none"),
    );
    field(
        &mut body,
        "instance",
        r.instance.as_deref().unwrap_or("none"),
    );
    if r.registry_degraded {
        field(
            &mut body,
            "shared registry",
            "unavailable for this request (checked in this instance only)",
        );
    }
    field(&mut body, "canary ids", &r.canary_ids.join(", "));
    field(&mut body, "request sha256", &r.request_sha256);
    field(&mut body, "response sha256", &r.response_sha256);
    field(
        &mut body,
        "chain",
        &format!("prev_hash {}", record.prev_hash),
    );
    body.markup("</dl>");

    frame(&format!("Record {}", record.id), Some(csrf), body)
}

/// The banner naming whose canaries were found in this answer.
fn exposed(body: &mut Page, detail: &Detail) {
    let mut hits: Vec<(String, String)> = detail
        .request
        .record
        .checks
        .iter()
        .filter(|check| check.name == "foreign_canary" && check.result == Status::Fail)
        .flat_map(|check| {
            check.evidence.value()["seen"]["hits"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .map(|hit| {
            (
                hit["session"].as_str().unwrap_or("unknown").to_owned(),
                hit["request"].as_str().unwrap_or("unknown").to_owned(),
            )
        })
        .collect();
    if hits.is_empty() {
        return;
    }
    let canaries = hits.len();
    hits.sort();
    hits.dedup();
    body.markup(
        "<div class=\"exposed\" id=\"exposed\"><strong>Exposed:</strong> this answer carried ",
    )
    .show(canaries)
    .markup(if canaries == 1 {
        " canary"
    } else {
        " canaries"
    })
    .markup(" of other requests: their owners' data reached this session. Tell the owners of:<ul>");
    for (session, request) in hits {
        body.markup("<li>session ")
            .link(&format!("/?session={}", url_encode(&session)), &session)
            .markup(", request ")
            .link(&format!("/?request={}", url_encode(&request)), &request)
            .markup("</li>");
    }
    body.markup("</ul></div>");
}

/// A record that is not a request (a review or a checkpoint).
pub fn other_record(record: &Record, line: &str, csrf: &str) -> String {
    let mut body = Page::new();
    body.markup("<h1>Record ").show(record.id).markup("</h1>");
    match &record.entry {
        Entry::Review(review) => {
            body.markup("<p>A review of ")
                .link(
                    &format!("/records/{}", review.reviewed_id),
                    &format!("record {}", review.reviewed_id),
                )
                .markup(".</p>");
        }
        Entry::Topic(topic) => {
            body.markup("<p>The topic score of ")
                .link(
                    &format!("/records/{}", topic.scored_id),
                    &format!("record {}", topic.scored_id),
                )
                .markup(": ")
                .text(&topic_words(&topic.score))
                .markup(".</p>");
        }
        _ => {
            body.markup("<p>Not a request record.</p>");
        }
    }
    body.markup("<pre class=\"evidence\">")
        .text(line)
        .markup("</pre>");
    frame(&format!("Record {}", record.id), Some(csrf), body)
}
