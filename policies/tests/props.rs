//! Property tests: the SSE parser, the stripper and the scanner.

mod common;

use canarygate_policies::canary::find_canaries;
use canarygate_policies::sse::{SseEvent, SseParser, encode_data};
use canarygate_policies::verify::Check;
use canarygate_policies::{Canary, EchoMode, Policy, Verifier};
use common::*;
use proptest::prelude::*;

/// Text that stresses the scanner: canary letters, digits, separators,
/// multi-byte characters and lookalike prefixes.
fn tricky_text() -> impl Strategy<Value = String> {
    proptest::collection::vec(
        prop_oneof![
            "[CcGg]",
            "[0-9]{1,4}",
            "[0-9A-Za-z]",
            "[ \\-_.,\n\"`']",
            Just("CG".to_owned()),
            Just("cg ".to_owned()),
            Just("CG-48".to_owned()),
            Just("é".to_owned()),
            Just("\u{2011}".to_owned()),
            Just("中".to_owned()),
        ],
        0..120,
    )
    .prop_map(|parts| parts.concat())
}

/// One of the ways a model may copy `canary`: `CG` in any case, digits in
/// groups of 1 to 15 with one of the separators between groups (and maybe
/// before the first).
fn variant(canary: Canary, style: u8, case_bits: u64) -> String {
    let canonical = canary.to_string();
    let separators = [
        "", " ", "-", "_", ".", ",", " - ", "\u{2011}", "\u{2014}", "\u{a0}", "\u{2009}",
        "\u{202f}",
    ];
    let separator = separators[usize::from(style) % separators.len()];
    let group = 1 + usize::from(style / 16) % 15;
    let mut out = String::new();
    for (index, c) in canonical[..2].chars().enumerate() {
        out.push(if case_bits >> index & 1 == 1 {
            c.to_ascii_lowercase()
        } else {
            c
        });
    }
    if case_bits >> 2 & 1 == 1 {
        out.push_str(separator);
    }
    for (index, digit) in canonical[2..].chars().enumerate() {
        if index > 0 && index % group == 0 {
            out.push_str(separator);
        }
        out.push(digit);
    }
    out
}

fn cuts() -> impl Strategy<Value = Vec<usize>> {
    proptest::collection::vec(0usize..400, 0..12)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn sse_parser_never_panics(chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 0..16)) {
        let mut parser = SseParser::new();
        let mut out = Vec::new();
        for chunk in &chunks {
            parser.feed(chunk, &mut out);
        }
        parser.finish();
    }

    #[test]
    fn sse_split_points_do_not_change_events(
        datas in proptest::collection::vec("[a-z\r\n:é ]{0,20}", 1..6),
        cuts in cuts(),
    ) {
        let mut bytes = Vec::new();
        for data in &datas {
            encode_data(data, &mut bytes);
        }
        let mut whole = Vec::new();
        SseParser::new().feed(&bytes, &mut whole);
        let mut points: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
        points.extend([0, bytes.len()]);
        points.sort_unstable();
        let mut parser = SseParser::new();
        let mut split: Vec<SseEvent> = Vec::new();
        for pair in points.windows(2) {
            parser.feed(&bytes[pair[0]..pair[1]], &mut split);
        }
        prop_assert_eq!(&split, &whole);
        let decoded: Vec<String> = split.into_iter().map(|event| event.data).collect();
        let expected: Vec<String> = datas.iter().map(|d| d.replace("\r\n", "\n").replace('\r', "\n")).collect();
        prop_assert_eq!(decoded, expected);
    }

    #[test]
    fn every_variant_is_found(raw in any::<[u8; 10]>(), style in any::<u8>(), case_bits in any::<u64>(),
                              before in tricky_text(), after in tricky_text()) {
        let canary = Canary::from_random(raw);
        let copy = variant(canary, style, case_bits);
        let text = format!("{before}{copy}{after}");
        let found: Vec<_> = find_canaries(&text).filter(|m| m.canary == canary).collect();
        prop_assert!(found.iter().any(|m| m.start == before.len() && m.end == before.len() + copy.len()),
            "{:?} in {:?}", copy, text);
    }

    #[test]
    fn strip_never_changes_non_canary_text(
        pieces in proptest::collection::vec(tricky_text(), 1..5),
        styles in proptest::collection::vec((any::<u8>(), any::<u64>(), any::<bool>()), 4),
        cuts in cuts(),
        echo_style in (any::<u8>(), any::<u64>()),
    ) {
        let policy = Policy::preset("default").unwrap();
        let registry = registry_with_others(4);
        let (_, injection) = prepare(&policy, &registry, chat_request(true), 1);
        let own = [injection.canaries.head, injection.canaries.tail];
        // Original text: the pieces joined; the answer has own canaries between them.
        let original: String = format!("x{}", pieces.concat());
        let mut answer = format!(
            "{} {}\nx",
            variant(own[0], echo_style.0, echo_style.1),
            variant(own[1], echo_style.0, echo_style.1),
        );
        for (piece, (style, case_bits, head)) in pieces.iter().zip(&styles) {
            answer.push_str(piece);
            answer.push_str(&variant(own[usize::from(!*head)], *style, *case_bits));
        }
        let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
        let run = feed(&mut verifier, &registry, &split_at(&answer, &cuts), &honest_facts(&injection, 1));
        prop_assert!(run.finished.verdict.passed(), "{:?}", run.finished.verdict);
        prop_assert_eq!(&run.released[0], &original);
    }

    #[test]
    fn split_points_never_hide_a_foreign_canary(
        before in tricky_text(), after in tricky_text(),
        style in any::<u8>(), case_bits in any::<u64>(), other in 0u64..4,
        cuts in cuts(), passive in any::<bool>(),
    ) {
        let mut policy = Policy::preset("default").unwrap();
        if passive {
            policy.verify.echo = EchoMode::Off;
        }
        let registry = registry_with_others(4);
        let (_, injection) = prepare(&policy, &registry, chat_request(true), 1);
        let (foreign, _) = other_canaries(other);
        let leak = variant(foreign, style, case_bits);
        let echo = if passive { String::new() } else { format!("{} ", echo_of(&injection)) };
        let answer = format!("{echo}x{before}{leak}{after}");
        let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
        let run = feed(&mut verifier, &registry, &split_at(&answer, &cuts), &honest_facts(&injection, 1));
        prop_assert_eq!(run.finished.verdict.failed_checks(), vec![Check::ForeignCanary]);
        // Nothing at or after the leak went out.
        let prefix = format!("x{before}");
        prop_assert!(prefix.starts_with(run.released[0].as_str()), "{:?}", run.released[0]);
        prop_assert!(find_canaries(&run.released[0]).all(|m| m.canary != foreign));
    }
}
