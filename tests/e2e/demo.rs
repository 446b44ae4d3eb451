//! `canarygate demo --json`: the incident replay, as a user runs it.

use serde_json::Value;

#[test]
fn demo_shows_leaks_direct_and_local_answers_through_canarygate() {
    let output = std::process::Command::new(crate::common::binary())
        // A quarter of the default traffic: the over-pool prompts are served by
        // a CPU engine on ~6,000-token prompts, which takes a while in debug builds.
        .args(["demo", "--json", "--sessions", "12"])
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
    assert_eq!(number("requests"), 48, "{report}");
    assert!(
        over_pool > 5 && over_pool < number("requests"),
        "prompts on both sides: {report}"
    );
    // Straight to the provider, every over-pool prompt got someone else's text with HTTP 200.
    assert_eq!(number("direct_leaks_delivered"), over_pool, "{report}");
    assert_eq!(number("direct_delivered"), number("requests"), "{report}");
    // Through canarygate none did: the probe found the provider's real limit
    // (within 5% under its pool), and every longer request was answered by
    // the local engine with HTTP 200 instead.
    let pool = number("pool_tokens");
    let probed = number("probed_limit_tokens");
    assert!(
        probed <= pool && probed as f64 >= 0.95 * pool as f64,
        "{report}"
    );
    assert_eq!(number("proxied_leaks_delivered"), 0, "{report}");
    assert_eq!(number("proxied_served_local"), over_pool, "{report}");
    assert_eq!(number("proxied_blocked"), 0, "{report}");
    assert_eq!(number("false_positives"), 0, "{report}");
    assert_eq!(number("proxied_delivered"), number("requests"), "{report}");
    // Each API alike: Chat Completions, Responses, Messages; every
    // over-pool prompt leaked direct and was served locally through
    // canarygate (a within-pool prompt sent locally would be a false alarm:
    // a streamed Responses answer once failed ttft on the instructions its
    // `response.created` repeats).
    for surface in ["chat_completions", "responses", "messages"] {
        let counts = &report["surfaces"][surface];
        let count = |key: &str| {
            counts[key]
                .as_u64()
                .unwrap_or_else(|| panic!("{surface} {key}: {report}"))
        };
        assert_eq!(count("requests"), 16, "{surface}: {report}");
        assert!(count("direct_leaks_delivered") > 0, "{surface}: {report}");
        assert_eq!(count("proxied_leaks_delivered"), 0, "{surface}: {report}");
        assert_eq!(
            count("proxied_served_local"),
            count("direct_leaks_delivered"),
            "{surface}: {report}"
        );
    }
    assert!(report["seconds"].as_f64().unwrap() < 120.0, "{report}");
}
