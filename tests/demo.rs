//! `canarygate demo --json`: the incident replay, as a user runs it.

mod common;

use serde_json::Value;

#[test]
fn demo_shows_leaks_direct_and_none_through_canarygate() {
    let output = std::process::Command::new(common::binary())
        .args(["demo", "--json"])
        .output()
        .expect("run demo");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: Value = serde_json::from_slice(&output.stdout).expect("one JSON object");
    let number = |key: &str| {
        report[key]
            .as_u64()
            .unwrap_or_else(|| panic!("{key}: {report}"))
    };
    let over_pool = number("over_pool_requests");
    assert!(number("requests") >= 100, "{report}");
    assert!(
        over_pool > 10 && over_pool < number("requests"),
        "prompts on both sides: {report}"
    );
    // Straight to the provider, every over-pool prompt got someone else's text with HTTP 200.
    assert_eq!(number("direct_leaks_delivered"), over_pool, "{report}");
    assert_eq!(number("direct_delivered"), number("requests"), "{report}");
    // Through canarygate none did, and only those were blocked.
    assert_eq!(number("proxied_leaks_delivered"), 0, "{report}");
    assert_eq!(number("proxied_blocked"), over_pool, "{report}");
    assert_eq!(number("false_positives"), 0, "{report}");
    assert_eq!(
        number("proxied_delivered"),
        number("requests") - over_pool,
        "{report}"
    );
    assert!(report["seconds"].as_f64().unwrap() < 60.0, "{report}");
}
