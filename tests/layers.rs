//! The layering Cargo cannot see: no import circle between the modules of any one parent inside
//! a crate of this workspace (between crates, Cargo forbids circles itself). For every pair of
//! modules under the same parent (the crate root included), if one names the other (`crate::`,
//! `super::` or `self::` paths, in code and tests alike), the other must not name it back, not
//! even through further siblings. A module and the modules inside it count as one.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The crates' source roots, relative to the workspace: the root package's library and binary,
/// and every crate under `crates/`.
fn crates(workspace: &Path) -> Vec<PathBuf> {
    let mut roots = vec![workspace.join("src"), workspace.join("src/bin/ebb")];
    let mut members: Vec<PathBuf> = std::fs::read_dir(workspace.join("crates"))
        .unwrap()
        .map(|e| e.unwrap().path().join("src"))
        .collect();
    members.sort();
    assert!(members.len() >= 8, "the crates under crates/: {members:?}");
    roots.extend(members);
    roots
}

type Module = Vec<String>;

/// Every `.rs` file under `root`, as the module path it defines.
fn modules(root: &Path) -> BTreeMap<Module, PathBuf> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                // A binary's modules are a crate of their own.
                if path.file_name().is_none_or(|n| n != "bin") {
                    dirs.push(path);
                }
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(root).unwrap().with_extension("");
            let mut m: Module = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if matches!(m.last().map(String::as_str), Some("mod" | "lib" | "main")) {
                m.pop();
            }
            out.insert(m, path);
        }
    }
    out
}

/// The source without its comments (line comments, doc comments included).
fn code(text: &str) -> String {
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) if !l[..i].contains('"') => &l[..i],
            _ => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The paths a use tree starting at `s` (right after `crate::`, `super::` or `self::`) names:
/// `a::b`, `a::{b, c::{d}}`, `{a, b}`.
fn use_paths(s: &str) -> Vec<Vec<String>> {
    fn tree(s: &[u8], mut i: usize, prefix: Vec<String>, out: &mut Vec<Vec<String>>) -> usize {
        let mut path = prefix;
        loop {
            while i < s.len() && s[i].is_ascii_whitespace() {
                i += 1;
            }
            if i < s.len() && s[i] == b'{' {
                i += 1;
                loop {
                    i = tree(s, i, path.clone(), out);
                    while i < s.len() && s[i].is_ascii_whitespace() {
                        i += 1;
                    }
                    match s.get(i) {
                        Some(b',') => i += 1,
                        Some(b'}') => return i + 1,
                        _ => return i,
                    }
                    while i < s.len() && s[i].is_ascii_whitespace() {
                        i += 1;
                    }
                    if s.get(i) == Some(&b'}') {
                        return i + 1;
                    }
                }
            }
            let start = i;
            while i < s.len() && (s[i].is_ascii_alphanumeric() || s[i] == b'_') {
                i += 1;
            }
            if start == i {
                out.push(path);
                return i;
            }
            path.push(String::from_utf8_lossy(&s[start..i]).into_owned());
            if s[i..].starts_with(b"::") {
                i += 2;
            } else {
                out.push(path);
                return i;
            }
        }
    }
    let mut out = Vec::new();
    tree(s.as_bytes(), 0, Vec::new(), &mut out);
    out
}

/// The modules of this crate that `module`'s source names.
fn named(module: &Module, text: &str, all: &BTreeMap<Module, PathBuf>) -> BTreeSet<Module> {
    let text = code(text);
    let mut out = BTreeSet::new();
    for (i, _) in text.match_indices("::") {
        let before = &text[..i];
        let word_start = before
            .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .map_or(0, |p| p + 1);
        let word = &before[word_start..];
        // Only the first segment of a path: `super::super::x` is read from its first `super`.
        if before[..word_start].ends_with("::") {
            continue;
        }
        let base: Module = match word {
            "crate" => Vec::new(),
            "self" => module.clone(),
            "super" => {
                let mut m = module.clone();
                let mut rest = &text[i + 2..];
                m.pop();
                while let Some(r) = rest.strip_prefix("super::") {
                    m.pop();
                    rest = r;
                }
                m
            }
            _ => continue,
        };
        let mut rest = &text[i + 2..];
        while let Some(r) = rest.strip_prefix("super::") {
            rest = r;
        }
        for path in use_paths(rest) {
            let mut full = base.clone();
            full.extend(path);
            // The longest prefix that is a module of this crate.
            while !full.is_empty() && !all.contains_key(&full) {
                full.pop();
            }
            if !full.is_empty() || word != "crate" {
                out.insert(full);
            }
        }
    }
    out
}

/// The circles in `edges`: each group of modules that name each other, through one another, with
/// the arrows between them.
fn circles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    let reaches = |from: &str, to: &str| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.to_owned()];
        while let Some(n) = todo.pop() {
            if n == to {
                return true;
            }
            if seen.insert(n.clone()) {
                todo.extend(edges.get(&n).into_iter().flatten().cloned());
            }
        }
        false
    };
    let mut groups: Vec<BTreeSet<String>> = Vec::new();
    for n in edges.keys() {
        if groups.iter().any(|g| g.contains(n)) {
            continue;
        }
        let group: BTreeSet<String> = edges
            .keys()
            .chain(edges.values().flatten())
            .filter(|m| *m != n && reaches(n, m) && reaches(m, n))
            .cloned()
            .chain([n.clone()])
            .collect();
        if group.len() > 1 {
            groups.push(group);
        }
    }
    groups
        .iter()
        .map(|g| {
            let arrows: Vec<String> = g
                .iter()
                .flat_map(|a| {
                    edges
                        .get(a)
                        .into_iter()
                        .flatten()
                        .filter(|b| g.contains(*b))
                        .map(move |b| format!("{a} -> {b}"))
                })
                .collect();
            arrows.join(", ")
        })
        .collect()
}

#[test]
fn no_module_names_a_sibling_that_names_it_back() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut found = Vec::new();
    for krate in crates(workspace) {
        let all = modules(&krate);
        assert!(!all.is_empty(), "{} has modules", krate.display());
        // Per parent module: the arrows between its children.
        let mut graphs: BTreeMap<Module, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
        for (module, path) in &all {
            let text = std::fs::read_to_string(path).unwrap();
            for target in named(module, &text, &all) {
                let common = module
                    .iter()
                    .zip(&target)
                    .take_while(|(a, b)| a == b)
                    .count();
                // One inside the other: one unit.
                if common == module.len() || common == target.len() {
                    continue;
                }
                graphs
                    .entry(module[..common].to_vec())
                    .or_default()
                    .entry(module[common].clone())
                    .or_default()
                    .insert(target[common].clone());
            }
        }
        for (parent, edges) in &graphs {
            let at = if parent.is_empty() {
                "crate".to_owned()
            } else {
                parent.join("::")
            };
            for c in circles(edges) {
                found.push(format!("{}: in {at}: {c}", krate.display()));
            }
        }
    }
    assert!(found.is_empty(), "import circles:\n{}", found.join("\n"));
}

#[test]
fn the_reader_finds_what_a_module_names() {
    let all: BTreeMap<Module, PathBuf> = [
        vec!["a".to_owned()],
        vec!["a".to_owned(), "b".to_owned()],
        vec!["c".to_owned()],
    ]
    .into_iter()
    .map(|m| (m, PathBuf::new()))
    .collect();
    let here = vec!["a".to_owned(), "b".to_owned()];
    let found = named(
        &here,
        "use crate::{c::X, a::{self, Y}};\n// crate::z::nothing\nfn f() { super::super::c::g() }",
        &all,
    );
    assert!(found.contains(&vec!["c".to_owned()]), "{found:?}");
    assert!(found.contains(&vec!["a".to_owned()]), "{found:?}");
    assert!(!found.iter().any(|m| m.first().is_some_and(|s| s == "z")));
}
