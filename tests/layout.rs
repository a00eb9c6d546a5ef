//! The source layout rules (ARCHITECTURE.md), checked on the
//! workspace's own files:
//!
//! - no two files of a crate import each other, directly or around a longer
//!   cycle (a file "imports" another when it names an item through a
//!   `crate::`, `super::`, `self::` or child-module path that resolves to
//!   that file; re-exports count, so a `mod.rs` that re-exports its children
//!   must not be named by them; `$crate::` in a macro body is not counted:
//!   it is resolved where the macro is used);
//! - no file of engine-core is longer than [`ENGINE_CORE_MAX_LINES`];
//! - each engine file that adds to `Shared` (engine/shared.rs) reaches, in
//!   its `impl Shared` blocks, exactly the parts of it that its header's
//!   `//! Reaches in Shared:` line names: a file that starts using another
//!   part says so where a reviewer sees it, and the engine's parts keep
//!   narrow users.
//!
//! Modules are found the way rustc finds them: from each crate root
//! (src/lib.rs, src/main.rs, src/bin/*.rs), following `mod name;` and
//! `#[path = "..."]`. Paths are read from a small lexer that skips
//! comments, strings and character literals.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const ENGINE_CORE_MAX_LINES: usize = 800;

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    Str(String),
    PathSep,
    Open,
    Close,
    Comma,
    Semi,
    Star,
    Hash,
    Dollar,
    Dot,
    Other,
}

fn lex(src: &str) -> Vec<Tok> {
    let c: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let at = |i: usize| c.get(i).copied().unwrap_or('\0');
    while i < c.len() {
        let ch = c[i];
        if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && at(i + 1) == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if ch == '"' {
            let start = i + 1;
            i += 1;
            while i < c.len() && c[i] != '"' {
                if c[i] == '\\' {
                    i += 1;
                }
                i += 1;
            }
            out.push(Tok::Str(c[start..i.min(c.len())].iter().collect()));
            i += 1;
        } else if (ch == 'r' || ch == 'b') && (at(i + 1) == '"' || at(i + 1) == '#')
            || (ch == 'b' && at(i + 1) == 'r' && (at(i + 2) == '"' || at(i + 2) == '#'))
        {
            // Raw or byte strings: r"..", r#".."#, b"..", br#".."#.
            let mut j = i + 1;
            if c[j] == 'r' {
                j += 1;
            }
            let raw = ch == 'r' || c[i + 1] == 'r';
            let mut hashes = 0;
            while at(j) == '#' {
                hashes += 1;
                j += 1;
            }
            if at(j) != '"' {
                // `r#ident` (a raw identifier): read the identifier.
                i += 2;
                continue;
            }
            j += 1;
            loop {
                if j >= c.len() {
                    break;
                }
                if !raw && c[j] == '\\' {
                    j += 2;
                    continue;
                }
                if c[j] == '"' && (0..hashes).all(|k| at(j + 1 + k) == '#') {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            out.push(Tok::Other);
            i = j;
        } else if ch == '\'' {
            // A character literal ('x', '\n', '\u{..}') or a lifetime.
            if at(i + 1) == '\\' {
                i += 2;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if at(i + 2) == '\'' {
                i += 3;
            } else {
                i += 1;
                while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                    i += 1;
                }
            }
            out.push(Tok::Other);
        } else if ch.is_alphabetic() || ch == '_' {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            out.push(Tok::Ident(c[start..i].iter().collect()));
        } else if ch.is_ascii_digit() {
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            out.push(Tok::Other);
        } else if ch == ':' && at(i + 1) == ':' {
            out.push(Tok::PathSep);
            i += 2;
        } else {
            out.push(match ch {
                '{' => Tok::Open,
                '}' => Tok::Close,
                ',' => Tok::Comma,
                ';' => Tok::Semi,
                '*' => Tok::Star,
                '#' => Tok::Hash,
                '$' => Tok::Dollar,
                '.' => Tok::Dot,
                _ => Tok::Other,
            });
            i += 1;
        }
    }
    out
}

/// One source file of a crate: its module path and what it declares.
struct File {
    path: PathBuf,
    module: Vec<String>,
    toks: Vec<Tok>,
    /// Child modules declared by `mod name;` or `mod name { .. }`.
    children: BTreeSet<String>,
}

/// Every file of the crate rooted at `root`, by module path.
fn crate_files(root: &Path) -> Vec<File> {
    let mut files = Vec::new();
    let mut todo = vec![(root.to_path_buf(), Vec::<String>::new(), true)];
    while let Some((path, module, mod_rs)) = todo.pop() {
        let src = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        let toks = lex(&src);
        let dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
        // Where `mod x;` finds x: beside a root or mod.rs, else in a folder
        // named after this file.
        let child_dir = if mod_rs {
            dir.clone()
        } else {
            dir.join(path.file_stem().unwrap_or_default())
        };
        let mut children = BTreeSet::new();
        let mut depth = 0usize;
        let mut path_attr: Option<String> = None;
        let mut k = 0;
        while k < toks.len() {
            match &toks[k] {
                Tok::Open => depth += 1,
                Tok::Close => {
                    depth = depth.saturating_sub(1);
                    path_attr = None;
                }
                Tok::Hash => {
                    // #[path = "file.rs"]
                    if let (Some(Tok::Ident(p)), Some(Tok::Str(s))) =
                        (toks.get(k + 2), toks.get(k + 4))
                    {
                        if p == "path" {
                            path_attr = Some(s.clone());
                        }
                    }
                }
                Tok::Ident(m) if m == "mod" => {
                    if let Some(Tok::Ident(name)) = toks.get(k + 1) {
                        children.insert(name.clone());
                        if depth == 0 && toks.get(k + 2) == Some(&Tok::Semi) {
                            let mut sub = module.clone();
                            sub.push(name.clone());
                            let (file, sub_mod_rs) = match path_attr.take() {
                                Some(p) => (dir.join(p), true),
                                None => {
                                    let flat = child_dir.join(format!("{name}.rs"));
                                    if flat.exists() {
                                        (flat, false)
                                    } else {
                                        (child_dir.join(name).join("mod.rs"), true)
                                    }
                                }
                            };
                            todo.push((file, sub, sub_mod_rs));
                        }
                    }
                    path_attr = None;
                }
                Tok::Semi => path_attr = None,
                _ => {}
            }
            k += 1;
        }
        files.push(File {
            path,
            module,
            toks,
            children,
        });
    }
    files
}

/// Expands the path (or `use` tree) starting at `toks[k]` into full paths.
fn use_tree(toks: &[Tok], k: &mut usize, prefix: Vec<String>, out: &mut Vec<Vec<String>>) {
    let mut path = prefix;
    loop {
        match toks.get(*k) {
            Some(Tok::Ident(s)) => {
                path.push(s.clone());
                *k += 1;
                if toks.get(*k) == Some(&Tok::PathSep) {
                    *k += 1;
                    continue;
                }
                out.push(path);
                return;
            }
            Some(Tok::Open) => {
                *k += 1;
                while *k < toks.len() && toks[*k] != Tok::Close {
                    if toks[*k] == Tok::Comma {
                        *k += 1;
                        continue;
                    }
                    let before = *k;
                    use_tree(toks, k, path.clone(), out);
                    // Skip `as name` and anything not part of a path.
                    while *k < toks.len() && !matches!(toks[*k], Tok::Comma | Tok::Close) {
                        *k += 1;
                    }
                    if *k == before {
                        *k += 1;
                    }
                }
                *k += 1;
                return;
            }
            _ => {
                // `*`, or the end of a path used in an expression.
                out.push(path);
                return;
            }
        }
    }
}

/// The files each file of a crate names, as indexes into `files`.
fn imports(files: &[File]) -> Vec<BTreeSet<usize>> {
    let by_module: BTreeMap<&[String], usize> = files
        .iter()
        .enumerate()
        .map(|(i, f)| (f.module.as_slice(), i))
        .collect();
    let resolve = |abs: &[String]| -> Option<usize> {
        (0..=abs.len())
            .rev()
            .find_map(|n| by_module.get(&abs[..n]).copied())
    };
    files
        .iter()
        .map(|f| {
            let mut found = BTreeSet::new();
            // Inline modules (mod tests { .. }) nest inside the file's.
            let mut inline: Vec<(String, usize)> = Vec::new();
            let mut depth = 0usize;
            let toks = &f.toks;
            let mut k = 0;
            while k < toks.len() {
                match &toks[k] {
                    Tok::Open => {
                        depth += 1;
                        k += 1;
                        continue;
                    }
                    Tok::Close => {
                        depth = depth.saturating_sub(1);
                        if inline.last().is_some_and(|(_, d)| *d > depth) {
                            inline.pop();
                        }
                        k += 1;
                        continue;
                    }
                    Tok::Ident(m)
                        if m == "mod"
                            && matches!(toks.get(k + 1), Some(Tok::Ident(_)))
                            && toks.get(k + 2) == Some(&Tok::Open) =>
                    {
                        if let Some(Tok::Ident(name)) = toks.get(k + 1) {
                            inline.push((name.clone(), depth + 1));
                        }
                        k += 2;
                        continue;
                    }
                    _ => {}
                }
                // `$crate::` in a macro is resolved where the macro is used.
                let starts_path = matches!(&toks[k], Tok::Ident(_))
                    && toks.get(k + 1) == Some(&Tok::PathSep)
                    && (k == 0 || !matches!(toks[k - 1], Tok::PathSep | Tok::Dollar));
                let Tok::Ident(first) = &toks[k] else {
                    k += 1;
                    continue;
                };
                let current: Vec<String> = f
                    .module
                    .iter()
                    .cloned()
                    .chain(inline.iter().map(|(n, _)| n.clone()))
                    .collect();
                let base = match first.as_str() {
                    _ if !starts_path => None,
                    "crate" => Some((Vec::new(), k + 2)),
                    "self" => Some((current.clone(), k + 2)),
                    "super" => {
                        let mut m = current.clone();
                        let mut j = k;
                        while toks.get(j) == Some(&Tok::Ident("super".into()))
                            && toks.get(j + 1) == Some(&Tok::PathSep)
                        {
                            m.pop();
                            j += 2;
                        }
                        Some((m, j))
                    }
                    // A child module by its relative name.
                    name if inline.is_empty() && f.children.contains(name) => {
                        Some((current.clone(), k))
                    }
                    _ => None,
                };
                let Some((base, mut j)) = base else {
                    k += 1;
                    continue;
                };
                let mut paths = Vec::new();
                use_tree(toks, &mut j, base, &mut paths);
                for mut p in paths {
                    p.retain(|s| s != "self");
                    if let Some(target) = resolve(&p) {
                        if !std::ptr::eq(&files[target], f) {
                            found.insert(target);
                        }
                    }
                }
                k = j.max(k + 1);
            }
            found
        })
        .collect()
}

/// Groups of files that reach each other through imports (Tarjan's
/// strongly connected components), larger than one file.
fn cycles(edges: &[BTreeSet<usize>]) -> Vec<Vec<usize>> {
    struct State<'a> {
        edges: &'a [BTreeSet<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on_stack: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(s: &mut State<'_>, v: usize) {
        s.index[v] = Some(s.next);
        s.low[v] = s.next;
        s.next += 1;
        s.stack.push(v);
        s.on_stack[v] = true;
        for &w in s.edges[v].iter() {
            match s.index[w] {
                None => {
                    visit(s, w);
                    s.low[v] = s.low[v].min(s.low[w]);
                }
                Some(iw) if s.on_stack[w] => s.low[v] = s.low[v].min(iw),
                _ => {}
            }
        }
        if Some(s.low[v]) == s.index[v] {
            let mut group = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack[w] = false;
                group.push(w);
                if w == v {
                    break;
                }
            }
            if group.len() > 1 {
                group.sort();
                s.out.push(group);
            }
        }
    }
    let n = edges.len();
    let mut s = State {
        edges,
        index: vec![None; n],
        low: vec![0; n],
        on_stack: vec![false; n],
        stack: Vec::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in 0..n {
        if s.index[v].is_none() {
            visit(&mut s, v);
        }
    }
    s.out
}

/// Every crate root of the workspace's members.
fn crate_roots() -> Vec<PathBuf> {
    let repo = ferry_tests::repo_root();
    let manifest = std::fs::read_to_string(repo.join("Cargo.toml")).expect("Cargo.toml");
    let members = manifest
        .split("members = [")
        .nth(1)
        .and_then(|s| s.split(']').next())
        .expect("a members list");
    let mut roots = Vec::new();
    for m in members.split(',') {
        let m = m.trim().trim_matches('"');
        if m.is_empty() {
            continue;
        }
        let src = repo.join(m).join("src");
        for r in ["lib.rs", "main.rs"] {
            if src.join(r).exists() {
                roots.push(src.join(r));
            }
        }
        if let Ok(bins) = std::fs::read_dir(src.join("bin")) {
            let mut bins: Vec<PathBuf> = bins.filter_map(|e| Some(e.ok()?.path())).collect();
            bins.sort();
            roots.extend(
                bins.into_iter()
                    .filter(|p| p.extension() == Some("rs".as_ref())),
            );
        }
    }
    roots
}

fn shown(p: &Path) -> String {
    let repo = ferry_tests::repo_root();
    p.strip_prefix(&repo).unwrap_or(p).display().to_string()
}

#[test]
fn no_two_files_of_a_crate_import_each_other() {
    let mut problems = Vec::new();
    let mut checked = 0;
    for root in crate_roots() {
        let files = crate_files(&root);
        checked += files.len();
        let edges = imports(&files);
        for group in cycles(&edges) {
            let members: BTreeSet<usize> = group.iter().copied().collect();
            let links: Vec<String> = group
                .iter()
                .flat_map(|&a| {
                    edges[a]
                        .iter()
                        .filter(|b| members.contains(b))
                        .map(|&b| format!("{} -> {}", shown(&files[a].path), shown(&files[b].path)))
                        .collect::<Vec<_>>()
                })
                .collect();
            problems.push(format!("  {}", links.join(", ")));
        }
    }
    assert!(
        checked > 50,
        "only {checked} files found: is the walk broken?"
    );
    assert!(
        problems.is_empty(),
        "files that import each other (move the shared type down a floor):\n{}",
        problems.join("\n")
    );
}

#[test]
fn no_engine_core_file_is_too_long() {
    let root = ferry_tests::repo_root().join("engine-core/src/lib.rs");
    let mut long: Vec<String> = crate_files(&root)
        .iter()
        .filter_map(|f| {
            let lines = std::fs::read_to_string(&f.path).ok()?.lines().count();
            (lines > ENGINE_CORE_MAX_LINES).then(|| format!("  {}: {lines} lines", shown(&f.path)))
        })
        .collect();
    long.sort();
    assert!(
        long.is_empty(),
        "engine-core files longer than {ENGINE_CORE_MAX_LINES} lines (one job per file):\n{}",
        long.join("\n")
    );
}

#[test]
fn the_checker_sees_a_cycle() {
    // Two files that name each other, as the lexer and resolver see them.
    let a = File {
        path: "a.rs".into(),
        module: vec!["a".into()],
        toks: lex("use crate::b::{self, B}; // crate::c::X in a comment\nfn f() { let s = \"crate::c::Y\"; }"),
        children: BTreeSet::new(),
    };
    let b = File {
        path: "b.rs".into(),
        module: vec!["b".into()],
        toks: lex("mod tests { use super::super::a::A; }"),
        children: ["tests".to_string()].into(),
    };
    let c = File {
        path: "c.rs".into(),
        module: vec!["c".into()],
        toks: lex(concat!(
            "pub(crate) struct Y<'a>(&'a u8); const Q: char = '\"';",
            "macro_rules! m { () => { $crate::a::A } }"
        )),
        children: BTreeSet::new(),
    };
    let edges = imports(&[a, b, c]);
    assert_eq!(edges[0], [1].into());
    assert_eq!(edges[1], [0].into());
    assert!(edges[2].is_empty());
    assert_eq!(cycles(&edges), vec![vec![0, 1]]);
}

/// The field names of `struct Shared` in engine/shared.rs.
fn shared_parts(src: &str) -> BTreeSet<String> {
    let body = src
        .split("pub(crate) struct Shared {")
        .nth(1)
        .and_then(|s| s.split("\n}").next())
        .expect("struct Shared in engine/shared.rs");
    body.lines()
        .filter_map(|l| l.trim().strip_prefix("pub(crate) "))
        .filter_map(|l| l.split(':').next())
        .map(str::to_string)
        .collect()
}

/// The parts of `Shared` that `self.<part>` names inside the file's
/// `impl Shared { .. }` blocks (comments and strings skipped by the lexer).
fn reached_parts(toks: &[Tok], parts: &BTreeSet<String>) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut k = 0;
    while k + 2 < toks.len() {
        let opens_impl = toks[k] == Tok::Ident("impl".into())
            && toks[k + 1] == Tok::Ident("Shared".into())
            && toks[k + 2] == Tok::Open;
        if !opens_impl {
            k += 1;
            continue;
        }
        let mut depth = 0usize;
        k += 2;
        while k < toks.len() {
            match &toks[k] {
                Tok::Open => depth += 1,
                Tok::Close => {
                    depth -= 1;
                    if depth == 0 {
                        break;
                    }
                }
                Tok::Ident(s) if s == "self" => {
                    if let (Some(Tok::Dot), Some(Tok::Ident(part))) =
                        (toks.get(k + 1), toks.get(k + 2))
                    {
                        if parts.contains(part) {
                            found.insert(part.clone());
                        }
                    }
                }
                _ => {}
            }
            k += 1;
        }
    }
    found
}

/// The parts a file's header names: `//! Reaches in Shared: a, b.` (or
/// `none.`), possibly continued on the next `//!` lines up to the period.
fn declared_parts(src: &str) -> Option<BTreeSet<String>> {
    let mut text = String::new();
    let mut lines = src
        .lines()
        .map(str::trim)
        .take_while(|l| l.starts_with("//!"));
    for l in lines.by_ref() {
        if let Some(rest) = l.strip_prefix("//! Reaches in Shared:") {
            text.push_str(rest);
            break;
        }
    }
    if text.is_empty() {
        return None;
    }
    while !text.trim_end().ends_with('.') {
        let l = lines.next()?;
        text.push(' ');
        text.push_str(l.trim_start_matches("//!"));
    }
    let list = text.trim().trim_end_matches('.').replace('`', "");
    Some(
        list.split(',')
            .map(|p| p.trim().to_string())
            .filter(|p| !p.is_empty() && p != "none")
            .collect(),
    )
}

#[test]
fn each_engine_file_reaches_only_the_parts_of_shared_its_header_names() {
    let engine = ferry_tests::repo_root().join("engine-core/src/engine");
    let parts = shared_parts(&std::fs::read_to_string(engine.join("shared.rs")).unwrap());
    assert!(parts.len() > 10, "Shared's parts not found: {parts:?}");
    let root = ferry_tests::repo_root().join("engine-core/src/lib.rs");
    let mut problems = Vec::new();
    let mut checked = 0;
    for f in crate_files(&root) {
        let in_engine = f.path.starts_with(&engine);
        let src = std::fs::read_to_string(&f.path).unwrap();
        let adds = f.toks.windows(3).any(|w| {
            w[0] == Tok::Ident("impl".into())
                && w[1] == Tok::Ident("Shared".into())
                && w[2] == Tok::Open
        });
        if !in_engine || !adds || f.path.ends_with("shared.rs") {
            continue;
        }
        checked += 1;
        let reached = reached_parts(&f.toks, &parts);
        match declared_parts(&src) {
            None => problems.push(format!(
                "  {}: no `//! Reaches in Shared:` line (it reaches {})",
                shown(&f.path),
                reached.iter().cloned().collect::<Vec<_>>().join(", ")
            )),
            Some(declared) if declared != reached => problems.push(format!(
                "  {}: names {:?}, reaches {:?}",
                shown(&f.path),
                declared,
                reached
            )),
            Some(_) => {}
        }
    }
    assert!(
        checked >= 10,
        "only {checked} engine files add to Shared: is the walk broken?"
    );
    assert!(
        problems.is_empty(),
        "engine files whose reach into Shared differs from their header:\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_reach_checker_reads_impl_blocks_and_headers() {
    let parts: BTreeSet<String> = ["memory", "segments", "batches"].map(String::from).into();
    let toks = lex("impl Other { fn f(&self) { self.batches; } }\n\
                    impl Shared { fn g(&self) { if x { self.memory.find(); } \"self.batches\"; } }\n\
                    // self.segments in a comment\n\
                    impl Shared { fn h(&self) -> u64 { self.segments.get() } }");
    assert_eq!(
        reached_parts(&toks, &parts),
        ["memory", "segments"].map(String::from).into()
    );
    let header = "//! A file.\n//!\n//! Reaches in Shared: `memory`,\n//! `segments`.\nuse x;";
    assert_eq!(
        declared_parts(header),
        Some(["memory", "segments"].map(String::from).into())
    );
    assert_eq!(
        declared_parts("//! Reaches in Shared: none.\n"),
        Some(BTreeSet::new())
    );
    assert_eq!(declared_parts("//! A file.\nuse x;"), None);
}
