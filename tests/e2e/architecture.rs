//! The workspace's shape, held by tests that read its sources: crates
//! depend one way, no module imports from a module that (transitively)
//! imports it, the proxy's layers only import downward, and no proxy file
//! grows past 500 lines without saying why. See docs/ARCHITECTURE.md.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The library crates, by directory, and the crate root file.
const CRATES: [(&str, &str); 9] = [
    ("policies", "src/lib.rs"),
    ("topic", "src/lib.rs"),
    ("audit", "src/lib.rs"),
    ("review", "src/lib.rs"),
    ("sim", "src/lib.rs"),
    ("proxy", "src/lib.rs"),
    ("local-engine", "src/lib.rs"),
    ("local-engine/gpu-kit", "src/main.rs"),
    (".", "src/main.rs"),
];

/// Which workspace crates each crate may depend on, and what it must not.
const DEPENDENCIES: [(&str, &[&str], &[&str]); 9] = [
    (
        "policies",
        &[],
        &[
            "tokio", "axum", "reqwest", "redb", "clap", "anyhow", "tracing",
        ],
    ),
    (
        "audit",
        &["canarygate-policies"],
        &["clap", "anyhow", "axum"],
    ),
    (
        "review",
        &["canarygate-policies", "canarygate-audit"],
        &["clap", "anyhow", "redb", "reqwest"],
    ),
    ("sim", &["canarygate-policies"], &["clap", "anyhow"]),
    // The embedding model and its scorer: no request, policy or audit types.
    ("topic", &[], &["axum", "reqwest", "redb", "clap", "anyhow"]),
    (
        "proxy",
        &[
            "canarygate-policies",
            "canarygate-audit",
            "canarygate-engine",
            "canarygate-topic",
        ],
        // Upstream I/O is hyper's own client, one layer (`upstream_client`).
        &["clap", "anyhow", "canarygate-sim", "redb", "reqwest"],
    ),
    ("local-engine", &[], &["clap", "anyhow"]),
    (
        "local-engine/gpu-kit",
        &["canarygate-engine"],
        &["tokio", "axum", "reqwest"],
    ),
    (
        ".",
        &[
            "canarygate-policies",
            "canarygate-audit",
            "canarygate-sim",
            "canarygate-proxy",
            "canarygate-review",
            "canarygate-engine",
            "canarygate-topic",
        ],
        &[],
    ),
];

/// The proxy's layers: a module may import from a lower layer; within
/// layers 1 and 2 (the shared pieces) from the same layer too; never from a
/// higher one, nor from another unit of layers 3 and up.
const PROXY_LAYERS: [(&str, u8); 37] = [
    ("server", 5),
    ("pipeline", 4),
    ("paths", 3),
    ("paths::verified", 3),
    ("paths::plain", 3),
    ("paths::local", 3),
    ("paths::passthrough", 3),
    ("probe", 3),
    ("body", 2),
    ("context", 2),
    ("engine", 2),
    ("identity", 2),
    ("probe_results", 2),
    ("registry", 2),
    ("relay", 2),
    ("shared_registry", 2),
    ("state", 2),
    ("topic", 2),
    ("trail", 2),
    ("upstream", 2),
    ("system_role", 1),
    ("upstream_body", 1),
    ("upstream_client", 2),
    ("upstream_setup", 2),
    ("wire", 2),
    ("wire::chat", 2),
    ("wire::completions", 2),
    ("wire::messages", 2),
    ("wire::responses", 2),
    ("wire::format", 2),
    ("wire::held", 2),
    ("wire::location", 2),
    ("wire::positions", 2),
    ("error", 1),
    ("clock", 1),
    ("metrics", 1),
    ("allocations", 1),
];

/// Most lines of a proxy source file whose opening comment does not say why
/// it is longer.
const MAX_PROXY_FILE_LINES: usize = 500;

/// The phrase that opening comment must carry.
const LONG_FILE_REASON: &str = "Longer than 500 lines:";

/// One module of a crate: its path (`paths::verified::stream`) and file.
#[derive(Debug)]
struct Module {
    path: String,
    file: PathBuf,
}

/// The file-backed modules of the crate rooted at `root_file`.
fn modules(root_file: &Path) -> Vec<Module> {
    let mut found = vec![Module {
        path: String::new(),
        file: root_file.to_owned(),
    }];
    let mut next = 0;
    while next < found.len() {
        let (path, file) = (found[next].path.clone(), found[next].file.clone());
        next += 1;
        let text = code_only(&std::fs::read_to_string(&file).unwrap());
        let dir = match file.file_name().and_then(|name| name.to_str()) {
            Some("lib.rs" | "main.rs" | "mod.rs") => file.parent().unwrap().to_owned(),
            _ => file.with_extension(""),
        };
        for name in declared_modules(&text) {
            let candidates = [
                dir.join(format!("{name}.rs")),
                dir.join(&name).join("mod.rs"),
            ];
            let child = candidates
                .into_iter()
                .find(|candidate| candidate.exists())
                .unwrap_or_else(|| panic!("{}: no file for `mod {name};`", file.display()));
            found.push(Module {
                path: join(&path, &name),
                file: child,
            });
        }
    }
    found
}

fn join(parent: &str, child: &str) -> String {
    if parent.is_empty() {
        child.to_owned()
    } else {
        format!("{parent}::{child}")
    }
}

/// `mod name;` declarations (not inline modules).
fn declared_modules(text: &str) -> Vec<String> {
    let tokens = tokens(text);
    let mut names = Vec::new();
    for (index, token) in tokens.iter().enumerate() {
        if token == "mod"
            && let (Some(name), Some(end)) = (tokens.get(index + 1), tokens.get(index + 2))
            && end == ";"
        {
            names.push(name.clone());
        }
    }
    names
}

/// `text` without comments, string and char literals, and inline modules
/// (`mod tests { ... }`: their imports are not the crate's structure).
fn code_only(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < bytes.len() {
        let rest = &text[i..];
        if rest.starts_with("//") {
            i += rest.find('\n').unwrap_or(rest.len());
        } else if rest.starts_with("/*") {
            i += rest.find("*/").map_or(rest.len(), |end| end + 2);
        } else if let Some(hashes) = raw_string_start(rest) {
            let close = format!("\"{}", "#".repeat(hashes));
            let body = 2 + hashes;
            i += body
                + rest[body..]
                    .find(&close)
                    .map_or(rest.len() - body, |end| end + close.len());
            out.push_str("\"\"");
        } else if bytes[i] == b'"' {
            let mut j = i + 1;
            while j < bytes.len() && bytes[j] != b'"' {
                j += if bytes[j] == b'\\' { 2 } else { 1 };
            }
            i = j + 1;
            out.push_str("\"\"");
        } else if bytes[i] == b'\'' && char_literal_len(rest).is_some() {
            i += char_literal_len(rest).unwrap();
            out.push_str("' '");
        } else {
            let c = rest.chars().next().unwrap();
            out.push(c);
            i += c.len_utf8();
        }
    }
    strip_inline_modules(&out)
}

/// `r"`, `r#"`, `br##"`...: the number of `#`s.
fn raw_string_start(text: &str) -> Option<usize> {
    let rest = text.strip_prefix('b').unwrap_or(text).strip_prefix('r')?;
    let hashes = rest.bytes().take_while(|&b| b == b'#').count();
    rest[hashes..].starts_with('"').then_some(hashes)
}

/// Length of a char literal at the start of `text` (`'a'`, `'\n'`, `'\u{1F600}'`).
fn char_literal_len(text: &str) -> Option<usize> {
    let mut chars = text.char_indices().skip(1);
    let (_, first) = chars.next()?;
    if first == '\\' {
        let close = text[2..].find('\'')?;
        return Some(close + 3);
    }
    let (at, second) = chars.next()?;
    (second == '\'').then_some(at + 1)
}

fn strip_inline_modules(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = find_inline_module(rest) {
        out.push_str(&rest[..at]);
        let open = at + rest[at..].find('{').unwrap();
        let mut depth = 0;
        let mut end = rest.len();
        for (offset, c) in rest[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + offset + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

/// Where `mod NAME {` starts in `text`.
fn find_inline_module(text: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(found) = text[from..].find("mod ") {
        let at = from + found;
        let before_ok = at == 0 || !is_ident(text.as_bytes()[at - 1]);
        let after = &text[at + 4..];
        let name_len = after.bytes().take_while(|&b| is_ident(b)).count();
        if before_ok && name_len > 0 && after[name_len..].trim_start().starts_with('{') {
            return Some(at);
        }
        from = at + 4;
    }
    None
}

fn is_ident(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || byte == b'_'
}

/// Identifiers and punctuation of `text`, `::` as one token.
fn tokens(text: &str) -> Vec<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b.is_ascii_whitespace() {
            i += 1;
        } else if is_ident(b) {
            let start = i;
            while i < bytes.len() && is_ident(bytes[i]) {
                i += 1;
            }
            out.push(text[start..i].to_owned());
        } else if text[i..].starts_with("::") {
            out.push("::".to_owned());
            i += 2;
        } else {
            let c = text[i..].chars().next().unwrap();
            out.push(c.to_string());
            i += c.len_utf8();
        }
    }
    out
}

/// Every path a module names from `crate::` or `super::`, resolved to
/// absolute module paths (`use` groups expanded).
fn referenced_paths(text: &str, module: &str) -> Vec<Vec<String>> {
    let tokens = tokens(text);
    let mut paths = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        let preceded_by_colons = i > 0 && tokens[i - 1] == "::";
        // `pub(super)`, `pub(crate)`, `pub(in crate::a)`: a visibility, not an import.
        let in_visibility = i >= 2
            && ((tokens[i - 1] == "(" && tokens[i - 2] == "pub")
                || (tokens[i - 1] == "in" && tokens[i - 2] == "("));
        if preceded_by_colons || in_visibility || !(tokens[i] == "crate" || tokens[i] == "super") {
            i += 1;
            continue;
        }
        let mut base: Vec<String> = module
            .split("::")
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect();
        if tokens[i] == "crate" {
            base.clear();
            i += 1;
        } else {
            while tokens.get(i).is_some_and(|t| t == "super") {
                base.pop();
                i += 1;
                if tokens.get(i).is_some_and(|t| t == "::")
                    && tokens.get(i + 1).is_some_and(|t| t == "super")
                {
                    i += 1;
                }
            }
        }
        if tokens.get(i).is_some_and(|t| t == "::") {
            i += 1;
            i = expand(&tokens, i, base, &mut paths);
        } else {
            paths.push(base);
        }
    }
    paths
}

/// Expands the path or `{...}` group at `tokens[i]` under `base` into
/// `paths`; returns the index after it.
fn expand(
    tokens: &[String],
    mut i: usize,
    mut base: Vec<String>,
    paths: &mut Vec<Vec<String>>,
) -> usize {
    loop {
        match tokens.get(i).map(String::as_str) {
            Some("{") => {
                i += 1;
                loop {
                    match tokens.get(i).map(String::as_str) {
                        Some("}") => return i + 1,
                        Some(",") => i += 1,
                        Some(_) => {
                            let next = expand(tokens, i, base.clone(), paths);
                            i = next.max(i + 1);
                        }
                        None => return i,
                    }
                }
            }
            Some(token) if token.bytes().all(is_ident) => {
                if token != "self" {
                    base.push(token.to_owned());
                }
                i += 1;
                if tokens.get(i).is_some_and(|t| t == "::") {
                    i += 1;
                    continue;
                }
                paths.push(base);
                return i;
            }
            // `*`, `as`, or the end of the path.
            Some("*") => {
                paths.push(base);
                return i + 1;
            }
            _ => {
                paths.push(base);
                return i;
            }
        }
    }
}

/// The crate's import graph: module -> modules it declares or names.
/// The crate root (which declares and re-exports) is left out.
fn graph(modules: &[Module]) -> BTreeMap<String, BTreeSet<String>> {
    let known: BTreeSet<&str> = modules.iter().map(|m| m.path.as_str()).collect();
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for module in modules.iter().filter(|m| !m.path.is_empty()) {
        let text = code_only(&std::fs::read_to_string(&module.file).unwrap());
        let mut targets = BTreeSet::new();
        for name in declared_modules(&text) {
            targets.insert(join(&module.path, &name));
        }
        for path in referenced_paths(&text, &module.path) {
            // The longest prefix that is a module.
            let target = (1..=path.len())
                .rev()
                .map(|n| path[..n].join("::"))
                .find(|candidate| known.contains(candidate.as_str()));
            if let Some(target) = target
                && target != module.path
            {
                targets.insert(target);
            }
        }
        edges.insert(module.path.clone(), targets);
    }
    edges
}

/// A cycle in `edges`, if any, as the modules along it.
fn find_cycle(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        Open,
        Done,
    }
    fn visit(
        node: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        marks: &mut BTreeMap<String, Mark>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        match marks.get(node) {
            Some(Mark::Done) => return None,
            Some(Mark::Open) => {
                let start = stack.iter().position(|n| n == node).unwrap();
                let mut cycle = stack[start..].to_vec();
                cycle.push(node.to_owned());
                return Some(cycle);
            }
            None => {}
        }
        marks.insert(node.to_owned(), Mark::Open);
        stack.push(node.to_owned());
        for next in edges.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, edges, marks, stack) {
                return Some(cycle);
            }
        }
        stack.pop();
        marks.insert(node.to_owned(), Mark::Done);
        None
    }
    let mut marks = BTreeMap::new();
    for node in edges.keys() {
        let mut stack = Vec::new();
        if let Some(cycle) = visit(node, edges, &mut marks, &mut stack) {
            return Some(cycle);
        }
    }
    None
}

#[test]
fn no_crate_has_an_import_cycle() {
    for (dir, root_file) in CRATES {
        let modules = modules(&root().join(dir).join(root_file));
        assert!(modules.len() > 1, "{dir}: no modules found");
        if let Some(cycle) = find_cycle(&graph(&modules)) {
            panic!(
                "{dir}: modules import each other in a circle: {}",
                cycle.join(" -> ")
            );
        }
    }
}

#[test]
fn the_cycle_check_sees_cycles_and_use_groups() {
    let mut edges = BTreeMap::new();
    edges.insert("a".to_owned(), BTreeSet::from(["b".to_owned()]));
    edges.insert("b".to_owned(), BTreeSet::from(["c".to_owned()]));
    edges.insert("c".to_owned(), BTreeSet::from(["a".to_owned()]));
    assert_eq!(
        find_cycle(&edges),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
    edges.get_mut("c").unwrap().clear();
    assert_eq!(find_cycle(&edges), None);
    let text = code_only(
        "use crate::{a::{b, c::D}, e};\nuse super::f::G; // crate::x\nfn h() { crate::i::j(); \
         let s = \"crate::k\"; }\nmod tests { use crate::l; }\npub(super) fn o() {}\n\
         pub(in crate::p) fn q() {}",
    );
    let paths = referenced_paths(&text, "m::n");
    let joined: Vec<String> = paths.iter().map(|p| p.join("::")).collect();
    assert_eq!(joined, ["a::b", "a::c::D", "e", "m::f::G", "i::j"]);
}

/// The layer a proxy module belongs to: its longest listed prefix.
fn proxy_layer(module: &str) -> (&'static str, u8) {
    PROXY_LAYERS
        .iter()
        .filter(|(unit, _)| module == *unit || module.starts_with(&format!("{unit}::")))
        .max_by_key(|(unit, _)| unit.len())
        .copied()
        .unwrap_or_else(|| {
            panic!("proxy module `{module}` has no layer: add it to PROXY_LAYERS and docs/ARCHITECTURE.md")
        })
}

#[test]
fn proxy_modules_import_only_downward() {
    let modules = modules(&root().join("proxy/src/lib.rs"));
    let known: BTreeSet<&str> = modules.iter().map(|m| m.path.as_str()).collect();
    let mut upward = Vec::new();
    for module in modules.iter().filter(|m| !m.path.is_empty()) {
        let (unit, rank) = proxy_layer(&module.path);
        let text = code_only(&std::fs::read_to_string(&module.file).unwrap());
        for path in referenced_paths(&text, &module.path) {
            let Some(target) = (1..=path.len())
                .rev()
                .map(|n| path[..n].join("::"))
                .find(|candidate| known.contains(candidate.as_str()) && !candidate.is_empty())
            else {
                continue;
            };
            let (target_unit, target_rank) = proxy_layer(&target);
            let allowed =
                target_unit == unit || target_rank < rank || (target_rank == rank && rank <= 2);
            if !allowed {
                upward.push(format!(
                    "{} (layer {rank}) imports {target} (layer {target_rank})",
                    module.path
                ));
            }
        }
    }
    assert!(
        upward.is_empty(),
        "imports against the layers:\n{}",
        upward.join("\n")
    );
}

/// `[dependencies]` of a crate's Cargo.toml, by name.
fn dependencies(dir: &str) -> Vec<String> {
    let text = std::fs::read_to_string(root().join(dir).join("Cargo.toml")).unwrap();
    let mut in_dependencies = false;
    let mut names = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            in_dependencies = line == "[dependencies]";
            continue;
        }
        if in_dependencies && let Some((name, _)) = line.split_once(['=', '.']) {
            let name = name.trim();
            if !name.is_empty() && !name.starts_with('#') {
                names.push(name.to_owned());
            }
        }
    }
    names
}

#[test]
fn crates_depend_one_way() {
    for (dir, allowed, forbidden) in DEPENDENCIES {
        let names = dependencies(dir);
        assert!(!names.is_empty(), "{dir}: no [dependencies] found");
        for name in &names {
            assert!(
                !name.starts_with("canarygate-") || allowed.contains(&name.as_str()),
                "{dir} depends on {name}, which it must not (dependencies point one way)"
            );
            assert!(
                !forbidden.contains(&name.as_str()),
                "{dir} must not depend on {name}"
            );
        }
    }
}

#[test]
fn proxy_files_stay_short_or_say_why() {
    let mut long = Vec::new();
    for module in modules(&root().join("proxy/src/lib.rs")) {
        let text = std::fs::read_to_string(&module.file).unwrap();
        let lines = text.lines().count();
        let opening: String = text
            .lines()
            .take_while(|line| line.starts_with("//!"))
            .collect();
        if lines > MAX_PROXY_FILE_LINES && !opening.contains(LONG_FILE_REASON) {
            long.push(format!("{} ({lines} lines)", module.file.display()));
        }
    }
    assert!(
        long.is_empty(),
        "over {MAX_PROXY_FILE_LINES} lines without `{LONG_FILE_REASON}` in the opening comment: {long:?}"
    );
}

/// The Markdown files of the repository (not build outputs, virtualenvs or
/// the npm packages the token-cost benchmark installs).
fn markdown_files(dir: &Path, found: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if path.is_dir() {
            if !name.starts_with('.')
                && !matches!(name.as_ref(), "target" | "results" | "node_modules")
            {
                markdown_files(&path, found);
            }
        } else if name.ends_with(".md") {
            found.push(path);
        }
    }
}

/// Every relative link of the documentation leads to a file of the
/// repository: none reaches outside it, none is broken.
#[test]
fn docs_link_only_inside_the_repository() {
    let root = root().canonicalize().unwrap();
    let mut files = Vec::new();
    markdown_files(&root, &mut files);
    assert!(files.len() > 5, "found only {files:?}");
    let mut bad = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        for (at, _) in text.match_indices("](") {
            let rest = &text[at + 2..];
            let Some(end) = rest.find(')') else { continue };
            let target = &rest[..end];
            if target.contains("://") || target.starts_with('#') || target.starts_with("mailto:") {
                continue;
            }
            let path = target.split('#').next().unwrap();
            let resolved = file.parent().unwrap().join(path);
            match resolved.canonicalize() {
                Ok(resolved) if resolved.starts_with(&root) => {}
                Ok(_) => bad.push(format!(
                    "{}: `{target}` leads outside the repository",
                    file.display()
                )),
                Err(_) => bad.push(format!("{}: `{target}` does not exist", file.display())),
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}
