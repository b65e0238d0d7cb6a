//! The runtime library's layer order, held by a test (docs/architecture.md is the map it keeps
//! honest). Every `.rs` file of `runtime/src` (the library: not `main.rs` or `cli/`, not
//! `tests.rs` files or `#[cfg(test)]` items) is a node. A file imports another when a path in
//! its code (a `use` tree, or inline: `crate::x::y(..)`) that starts with `crate`, `super`,
//! `self` or one of its own child modules reaches that file: the deepest module file on the path
//! (`a/b.rs` or `a/b/mod.rs`), whose items belong to it. Naming an item of an ancestor module is
//! no import. There must be no cycle between files, and a top-level room may import only itself
//! and rooms of strictly lower [`LAYERS`]. Standard library only.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::{fs, path::Path};

/// The rooms of `runtime/src` (a top-level folder, or a file `x.rs` as room `x`) by layer,
/// lowest first. A room missing here fails the test: a new room is placed deliberately.
const LAYERS: &str = "serve init < auth < vision dist < model < chat < engine < algorithms router
    < trainer loopback < agents weight_sync < rollout < error < config < records < stages < learner
    < local cluster";

/// A module's path from the crate root (`["engine", "core"]`; the root is `[]`).
type Module = Vec<String>;
/// A token of code and its line.
type Token = (String, usize);
/// (importer, imported) file -> the importer's lines that name the imported file.
type Edges = BTreeMap<(String, String), BTreeSet<usize>>;

#[test]
fn runtime_files_import_downward_only_and_without_cycles() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = BTreeMap::new();
    library_files(&src, "", &mut files);
    let mut edges = Edges::new();
    for (module, file) in &files {
        let children: BTreeSet<&str> = files
            .keys()
            .filter(|m| m.len() == module.len() + 1 && m.starts_with(module))
            .map(|m| m[module.len()].as_str())
            .collect();
        let tokens = tokens(&fs::read_to_string(src.join(file)).unwrap());
        for (path, line) in imports(&tokens, module, &children) {
            let (target_module, target) = (0..=path.len())
                .rev()
                .find_map(|n| files.get_key_value(&path[..n]))
                .expect("lib.rs is the module of every path");
            if !module.starts_with(target_module) {
                edges
                    .entry((file.clone(), target.clone()))
                    .or_default()
                    .insert(line);
            }
        }
    }

    let room = |file: &str| file.split(['/', '.']).next().unwrap().to_string();
    let layer = |room: &str| {
        LAYERS
            .split('<')
            .position(|l| l.split_whitespace().any(|r| r == room))
    };
    let at = |file: &str, lines: &BTreeSet<usize>| {
        let lines: Vec<String> = lines.iter().map(usize::to_string).collect();
        format!("{file}:{}", lines.join(","))
    };
    let mut report = Vec::new();
    let cycles = cycles(&edges);
    for cycle in &cycles {
        report.push(format!("cycle between {}:", cycle.join(", ")));
        for ((from, to), lines) in &edges {
            if cycle.contains(from) && cycle.contains(to) {
                report.push(format!("  {} -> {to}", at(from, lines)));
            }
        }
    }
    let rooms: BTreeSet<String> = files
        .values()
        .filter(|f| *f != "lib.rs")
        .map(|f| room(f))
        .collect();
    for unplaced in rooms.iter().filter(|r| layer(r).is_none()) {
        report.push(format!(
            "room {unplaced} is not in LAYERS: place it in the table"
        ));
    }
    let mut upward = 0;
    for ((from, to), lines) in &edges {
        let (low, high) = (room(from), room(to));
        if let (Some(l), Some(h)) = (layer(&low), layer(&high)) {
            if low != high && h >= l {
                upward += 1;
                let from = at(from, lines);
                report.push(format!(
                    "upward import {from}: {low} ({l}) names {to} ({h})"
                ));
            }
        }
    }
    let summary = format!(
        "architecture: {} files, {} edges, {} cycles, {upward} upward imports",
        files.len(),
        edges.len(),
        cycles.len()
    );
    // Straight to stderr: the harness captures `eprintln!` of a passing test, and these counts
    // are wanted every time.
    let _ = writeln!(std::io::stderr(), "{summary}");
    assert!(report.is_empty(), "{summary}\n{}", report.join("\n"));
}

#[test]
fn docs_architecture_names_every_top_level_folder_and_file() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let doc = fs::read_to_string(root.join("docs/architecture.md")).unwrap();
    // `needle` not followed by more of a name (`runtime/src/run` is not `runtime/src/run.rs`).
    let names = |needle: &str| {
        let more = |c: char| c.is_alphanumeric() || matches!(c, '_' | '.');
        doc.match_indices(needle)
            .any(|(at, _)| !doc[at + needle.len()..].starts_with(more))
    };
    let mut missing = Vec::new();
    for dir in ["runtime/src", "operator/src"] {
        for entry in fs::read_dir(root.join(dir)).unwrap().map(Result::unwrap) {
            let name = entry.file_name().into_string().unwrap();
            let folder = entry.file_type().unwrap().is_dir();
            // Every crate has its roots; the rooms under them are what a reader looks up.
            let root_file = matches!(name.as_str(), "lib.rs" | "main.rs");
            let bare = |before: &str| doc.contains(&format!("{before}{name}/"));
            if !root_file
                && !names(&format!("{dir}/{name}"))
                && !(folder && (bare("`") || bare(" ")))
            {
                missing.push(format!("{dir}/{name}"));
            }
        }
    }
    missing.sort();
    assert!(
        missing.is_empty(),
        "docs/architecture.md does not mention {}",
        missing.join(", ")
    );
}

#[test]
fn the_readme_lists_every_docs_page_and_every_room() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let readme = fs::read_to_string(root.join("README.md")).unwrap();
    let mut missing = Vec::new();
    for entry in fs::read_dir(root.join("docs")).unwrap().map(Result::unwrap) {
        let name = entry.file_name().into_string().unwrap();
        if name.ends_with(".md") && !readme.contains(&format!("(docs/{name})")) {
            missing.push(format!("docs/{name}"));
        }
    }
    // The layout table names each folder of the runtime's library.
    for entry in fs::read_dir(root.join("runtime/src"))
        .unwrap()
        .map(Result::unwrap)
    {
        let name = entry.file_name().into_string().unwrap();
        if entry.file_type().unwrap().is_dir() && !readme.contains(&format!("`{name}/`")) {
            missing.push(format!("runtime/src/{name}/"));
        }
    }
    missing.sort();
    assert!(
        missing.is_empty(),
        "README.md does not list {}",
        missing.join(", ")
    );
}

/// The library's `.rs` files under `dir` (`rel` from `runtime/src`), by module.
fn library_files(dir: &Path, rel: &str, files: &mut BTreeMap<Module, String>) {
    for entry in fs::read_dir(dir).unwrap().map(Result::unwrap) {
        let name = entry.file_name().into_string().unwrap();
        let path = format!("{rel}{name}");
        let binary = matches!(path.as_str(), "main.rs" | "cli");
        if binary || matches!(name.as_str(), "tests.rs" | "tests") {
            continue;
        }
        if entry.file_type().unwrap().is_dir() {
            library_files(&entry.path(), &format!("{path}/"), files);
        } else if let Some(stem) = path.strip_suffix(".rs") {
            let stem = stem.strip_suffix("/mod").unwrap_or(stem);
            let module = stem.split('/').filter(|s| *s != "lib").map(String::from);
            files.insert(module.collect(), path);
        }
    }
}

/// The files on a cycle, one list per strongly connected component (files that reach each other).
fn cycles(edges: &Edges) -> Vec<Vec<String>> {
    let reach = |start: &String| {
        let (mut seen, mut todo) = (BTreeSet::new(), vec![start.clone()]);
        while let Some(node) = todo.pop() {
            for (_, to) in edges.keys().filter(|(from, _)| *from == node) {
                if seen.insert(to.clone()) {
                    todo.push(to.clone());
                }
            }
        }
        seen
    };
    let reached: BTreeMap<&String, BTreeSet<String>> =
        edges.keys().map(|(f, _)| (f, reach(f))).collect();
    let mut components: Vec<Vec<String>> = Vec::new();
    for (node, from_node) in &reached {
        if from_node.contains(*node) && !components.iter().any(|c| c.contains(*node)) {
            let back = |m: &&String| reached.get(m).is_some_and(|r| r.contains(*node));
            components.push(from_node.iter().filter(back).cloned().collect());
        }
    }
    components
}

/// The identifiers, `::` and other punctuation of `source`, each with its line; comments and
/// string and character literals are skipped (block comments do not nest: the runtime has none).
fn tokens(source: &str) -> Vec<Token> {
    let s = source.as_bytes();
    let at = |i: usize, pattern: &str| {
        s.get(i..)
            .is_some_and(|r| r.starts_with(pattern.as_bytes()))
    };
    let word = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b'$' || c >= 0x80;
    let (mut tokens, mut line, mut i) = (Vec::new(), 1, 0);
    while i < s.len() {
        let start = i;
        // A raw string (`r"..."`, `br#"..."#`) opens with `r`, its hashes and a quote.
        let r = i + usize::from(s[i] == b'b');
        let hashes = s.iter().skip(r + 1).take_while(|c| **c == b'#').count();
        // Where a comment's or literal's text starts, what closes it, and whether `\` escapes.
        let skip = if at(i, "//") {
            Some((i, "\n".to_string(), false))
        } else if at(i, "/*") {
            Some((i + 2, "*/".into(), false))
        } else if at(r, "r") && at(r + 1 + hashes, "\"") {
            Some((r + 2 + hashes, format!("\"{}", "#".repeat(hashes)), false))
        } else if at(i, "\"") || at(i, "b\"") {
            Some((r + 1, "\"".into(), true))
        } else if at(i, "'") && (at(i + 1, "\\") || at(i + 2, "'")) {
            Some((i + 1, "'".into(), true))
        } else {
            None
        };
        if let Some((mut j, close, escapes)) = skip {
            while j < s.len() && !at(j, &close) {
                j += if escapes && s[j] == b'\\' { 2 } else { 1 };
            }
            i = j + close.len();
        } else {
            i += match s[i] {
                c if word(c) => s[i..].iter().take_while(|c| word(**c)).count(),
                b':' if at(i, "::") => 2,
                _ => 1,
            };
            if !s[start].is_ascii_whitespace() {
                tokens.push((String::from_utf8_lossy(&s[start..i]).into_owned(), line));
            }
        }
        line += s[start..i.min(s.len())]
            .iter()
            .filter(|c| **c == b'\n')
            .count();
    }
    tokens
}

/// The modules that `tokens` (the code of `module`, whose child modules are `children`) name,
/// from the crate root, each with its line.
fn imports(tokens: &[Token], module: &[String], children: &BTreeSet<&str>) -> Vec<(Module, usize)> {
    let tok = |k: usize| tokens.get(k).map_or("", |t| t.0.as_str());
    let starts_path = |i: usize| {
        tok(i).starts_with(|c: char| c.is_alphabetic() || c == '_' || c == '$')
            && tok(i + 1) == "::"
            && !matches!(tok(i.wrapping_sub(1)), "::" | ".")
    };
    let (mut paths, mut i) = (Vec::new(), 0);
    while i < tokens.len() {
        if (i..i + 7)
            .map(tok)
            .eq(["#", "[", "cfg", "(", "test", ")", "]"])
        {
            // Skip the item: up to its `;`, or to the `}` that closes its body.
            let mut depth = 0;
            while let Some((t, _)) = tokens.get(i) {
                i += 1;
                depth += i32::from(t == "{") - i32::from(t == "}");
                if (t == "}" && depth <= 0) || (t == ";" && depth == 0) {
                    break;
                }
            }
        } else if tok(i) == "use" {
            i = use_tree(tokens, i + 1, Vec::new(), &mut paths);
        } else if starts_path(i) {
            // An inline path reads as a use tree that ends at its first other token (`(`, `<`).
            i = use_tree(tokens, i, Vec::new(), &mut paths);
        } else {
            i += 1;
        }
    }
    let resolve = |(path, line): (Module, usize)| Some((absolute(module, &path, children)?, line));
    paths.into_iter().filter_map(resolve).collect()
}

/// `path` as seen from `here`, from the crate root; `None` for another crate's path.
fn absolute(here: &[String], path: &[String], children: &BTreeSet<&str>) -> Option<Module> {
    let (mut base, mut rest) = (here.to_vec(), path);
    match path.first()?.as_str() {
        "crate" | "$crate" => (base, rest) = (Vec::new(), &path[1..]),
        "self" => rest = &path[1..],
        first if first == "super" || children.contains(first) => {}
        _ => return None,
    }
    while rest.first().is_some_and(|s| s == "super") {
        base.pop()?;
        rest = &rest[1..];
    }
    Some([base, rest.to_vec()].concat())
}

/// Reads the use tree at `i` (below `path`) into `leaves`, each path with its line; returns the
/// index after it.
fn use_tree(
    tokens: &[Token],
    mut i: usize,
    mut path: Module,
    leaves: &mut Vec<(Module, usize)>,
) -> usize {
    while let Some((tok, line)) = tokens.get(i) {
        i += 1;
        match tok.as_str() {
            "::" => continue,
            "{" => {
                while let Some((next, _)) = tokens.get(i).filter(|t| t.0 != "}") {
                    i = match next.as_str() {
                        "," => i + 1,
                        _ => use_tree(tokens, i, path.clone(), leaves).max(i + 1),
                    };
                }
                return i + 1;
            }
            name if name.starts_with(|c: char| c.is_alphabetic() || c == '_' || c == '$') => {
                path.push(name.to_string());
                if tokens.get(i).is_some_and(|t| t.0 == "::") {
                    continue;
                }
                i += if tokens.get(i).is_some_and(|t| t.0 == "as") {
                    2
                } else {
                    0
                };
            }
            // `*`, `,`, `;` or another token ends the path.
            _ => {}
        }
        if path.last().is_some_and(|s| s == "self") {
            path.pop();
        }
        if !path.is_empty() {
            leaves.push((path, *line));
        }
        return i;
    }
    i
}

#[test]
fn the_parser_reads_use_trees_and_inline_paths_and_skips_comments_strings_and_tests() {
    let source = r##"
use super::{a::B, c};
pub(crate) use crate::x::{self, y::{z, w as v}, *};
// use crate::in_a_comment::X;
/* crate::in_a_block
   crate::still_in_it */
fn f<'a>(s: &'a str) -> char {
    let _ = ("crate::in_a_string", r#"crate::raw " string"#, '"', crate::inline::call(1));
    kid::run(s.parse::<u8>(), super::super::up::Thing { a: 1 });
    'x'
}
#[cfg(test)]
mod tests { use crate::only_in_tests; }
"##;
    let module: Module = vec!["m".into(), "n".into()];
    let found: Vec<String> = imports(&tokens(source), &module, &BTreeSet::from(["kid"]))
        .into_iter()
        .map(|(path, line)| format!("{}@{line}", path.join("::")))
        .collect();
    let expected =
        "m::a::B@2 m::c@2 x@3 x::y::z@3 x::y::w@3 x@3 inline::call@8 m::n::kid::run@9 up::Thing@9";
    assert_eq!(found.join(" "), expected);
}

#[test]
fn the_cycle_finder_reports_each_component_once() {
    let edge = |a: &str, b: &str| ((a.to_string(), b.to_string()), BTreeSet::from([1]));
    let edges = Edges::from([
        edge("a", "b"),
        edge("b", "a"),
        edge("b", "c"),
        edge("c", "d"),
        edge("d", "c"),
    ]);
    assert_eq!(cycles(&edges), [vec!["a", "b"], vec!["c", "d"]]);
}
