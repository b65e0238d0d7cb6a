//! The chart's monitoring options (docs/monitoring.md): the Grafana dashboard queries only
//! metrics some component exports, read from the code that registers them (so renaming a metric
//! fails here), and `helm template` with the options on renders a ServiceMonitor that selects
//! the operator's metrics Service, a PodMonitor that selects every run's pods and scrapes each
//! port that serves their `/metrics`, and the dashboard's ConfigMap.
//!
//! Only the `helm template` test needs anything: the `helm` of the test control plane's binaries
//! (`scripts/cluster-build.sh`, found through `MOULT_K8S_BIN` or `scripts/test-cluster.sh env`),
//! so it is ignored and runs in `scripts/test.sh`'s cluster phase. The reading of the sources
//! errs on the strict side: a registration it cannot read fails the test rather than passing a
//! name nothing exports.

mod support;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;

use moult_operator::children::{
    desired, Children, Config, COMPONENT_LABEL, MANAGED_BY, MANAGED_BY_LABEL, RUN_LABEL,
};
use serde_json::{json, Value};
use support::runs::run_kinds;
use support::ROOT;

const CHART: &str = "charts/moult-operator";
const DASHBOARD: &str = "charts/moult-operator/dashboards/moult.json";

// ---------------------------------------------------------------------------------------------
// The metrics the code registers, read from its sources.
// ---------------------------------------------------------------------------------------------

/// A token of Rust source, with its line.
#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    Str(String),
    Punct(String),
}

#[derive(Clone, Debug)]
struct Token {
    tok: Tok,
    line: usize,
}

/// Rust source as tokens: comments dropped, string literals (raw ones too) whole, lifetimes and
/// numbers as identifiers, `::` as one punctuation token.
fn lex(src: &str) -> Vec<Token> {
    let c: Vec<char> = src.chars().collect();
    let (mut i, mut line, mut out) = (0, 1, Vec::new());
    let at = |i: usize| c.get(i).copied().unwrap_or('\0');
    let ident_char = |ch: char| ch.is_alphanumeric() || ch == '_';
    while i < c.len() {
        let ch = c[i];
        let start_line = line;
        let mut push = |tok: Tok| {
            out.push(Token {
                tok,
                line: start_line,
            })
        };
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && at(i + 1) == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            loop {
                if at(i) == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if at(i) == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if at(i) == '\n' {
                        line += 1;
                    }
                    i += 1;
                }
                assert!(i <= c.len(), "an unterminated comment");
            }
        } else if (ch == 'r' && matches!(at(i + 1), '"' | '#'))
            || (ch == 'b' && at(i + 1) == 'r' && matches!(at(i + 2), '"' | '#'))
        {
            // A raw string: r"…", r#"…"#, br"…".
            i += if ch == 'b' { 2 } else { 1 };
            let mut hashes = 0;
            while at(i) == '#' {
                hashes += 1;
                i += 1;
            }
            if at(i) != '"' {
                // `r#ident`: a raw identifier.
                let s = i;
                while ident_char(at(i)) {
                    i += 1;
                }
                push(Tok::Ident(c[s..i].iter().collect()));
                continue;
            }
            i += 1;
            let s = i;
            loop {
                assert!(i < c.len(), "an unterminated raw string");
                if c[i] == '"' && (1..=hashes).all(|k| at(i + k) == '#') {
                    break;
                }
                if c[i] == '\n' {
                    line += 1;
                }
                i += 1;
            }
            push(Tok::Str(c[s..i].iter().collect()));
            i += 1 + hashes;
        } else if ch == '"' || (ch == 'b' && at(i + 1) == '"') {
            i += if ch == 'b' { 2 } else { 1 };
            let mut s = String::new();
            while at(i) != '"' {
                assert!(i < c.len(), "an unterminated string");
                if c[i] == '\\' {
                    s.push(c[i]);
                    i += 1;
                }
                if c[i] == '\n' {
                    line += 1;
                }
                s.push(c[i]);
                i += 1;
            }
            push(Tok::Str(s));
            i += 1;
        } else if ch == '\'' {
            if at(i + 1) == '\\' {
                // '\n', '\'', '\u{..}'
                i += 2;
                while at(i) != '\'' {
                    i += 1;
                }
                i += 1;
            } else if at(i + 2) == '\'' {
                i += 3;
            } else {
                // A lifetime.
                let s = i;
                i += 1;
                while ident_char(at(i)) {
                    i += 1;
                }
                push(Tok::Ident(c[s..i].iter().collect()));
            }
        } else if ident_char(ch) {
            let s = i;
            while ident_char(at(i))
                || (ch.is_ascii_digit() && at(i) == '.' && at(i + 1).is_ascii_digit())
            {
                i += 1;
            }
            push(Tok::Ident(c[s..i].iter().collect()));
        } else if ch == ':' && at(i + 1) == ':' {
            push(Tok::Punct("::".into()));
            i += 2;
        } else {
            push(Tok::Punct(ch.to_string()));
            i += 1;
        }
    }
    out
}

/// What prometheus-client exposes a metric as.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Kind {
    Gauge,
    Counter,
    Histogram,
}

impl Kind {
    /// The series names of a metric registered as `name` (prometheus-client 0.23's text format:
    /// a counter gets `_total`, a histogram `_bucket`, `_sum` and `_count`).
    fn series(self, name: &str) -> Vec<String> {
        match self {
            Kind::Gauge => vec![name.to_string()],
            Kind::Counter => vec![format!("{name}_total")],
            Kind::Histogram => ["bucket", "sum", "count"]
                .iter()
                .map(|s| format!("{name}_{s}"))
                .collect(),
        }
    }
}

/// One Rust source file, tokenized.
struct Source {
    path: String,
    toks: Vec<Token>,
}

impl Source {
    fn is(&self, i: usize, tok: &str) -> bool {
        match self.toks.get(i).map(|t| &t.tok) {
            Some(Tok::Ident(s)) | Some(Tok::Punct(s)) => s == tok,
            _ => false,
        }
    }

    fn ident(&self, i: usize) -> Option<&str> {
        match self.toks.get(i).map(|t| &t.tok) {
            Some(Tok::Ident(s)) => Some(s),
            _ => None,
        }
    }

    fn at(&self, i: usize) -> String {
        format!("{}:{}", self.path, self.toks.get(i).map_or(0, |t| t.line))
    }

    /// The index of the bracket closing the one at `open`.
    fn close(&self, open: usize) -> usize {
        let mut depth = 0i32;
        for j in open..self.toks.len() {
            match &self.toks[j].tok {
                Tok::Punct(p) if matches!(p.as_str(), "(" | "[" | "{") => depth += 1,
                Tok::Punct(p) if matches!(p.as_str(), ")" | "]" | "}") => {
                    depth -= 1;
                    if depth == 0 {
                        return j;
                    }
                }
                _ => {}
            }
        }
        panic!("{}: an unclosed bracket", self.at(open))
    }

    /// The comma-separated items between the bracket at `open` and its match, as index ranges.
    fn items(&self, open: usize) -> Vec<(usize, usize)> {
        let close = self.close(open);
        let (mut items, mut start, mut depth) = (Vec::new(), open + 1, 0i32);
        for j in open + 1..close {
            match &self.toks[j].tok {
                Tok::Punct(p) if matches!(p.as_str(), "(" | "[" | "{") => depth += 1,
                Tok::Punct(p) if matches!(p.as_str(), ")" | "]" | "}") => depth -= 1,
                Tok::Punct(p) if p == "," && depth == 0 => {
                    items.push((start, j));
                    start = j + 1;
                }
                _ => {}
            }
        }
        if start < close {
            items.push((start, close));
        }
        items
    }

    /// The first of `;` at the depth of `from`.
    fn statement_end(&self, from: usize) -> usize {
        let mut depth = 0i32;
        for j in from..self.toks.len() {
            match &self.toks[j].tok {
                Tok::Punct(p) if matches!(p.as_str(), "(" | "[" | "{") => depth += 1,
                Tok::Punct(p) if matches!(p.as_str(), ")" | "]" | "}") => {
                    depth -= 1;
                    if depth < 0 {
                        return j;
                    }
                }
                Tok::Punct(p) if p == ";" && depth == 0 => return j,
                _ => {}
            }
        }
        self.toks.len()
    }

    /// The metric kind the tokens `from..to` name first (a type or a constructor), through the
    /// file's type aliases.
    fn kind_in(&self, from: usize, to: usize) -> Option<Kind> {
        for j in from..to {
            match self.ident(j) {
                Some("Gauge") => return Some(Kind::Gauge),
                Some("Counter") => return Some(Kind::Counter),
                Some("Histogram") => return Some(Kind::Histogram),
                Some(alias) => {
                    if let Some(k) = (0..self.toks.len().saturating_sub(2)).find(|&k| {
                        self.is(k, "type")
                            && self.ident(k + 1) == Some(alias)
                            && self.is(k + 2, "=")
                    }) {
                        let end = self.statement_end(k + 3);
                        if let Some(kind) = self.kind_in(k + 3, end) {
                            return Some(kind);
                        }
                    }
                }
                None => {}
            }
        }
        None
    }

    /// The kind of the metric value `from..to` (the registration's third argument): a
    /// constructor, a local `let`, or a field of a struct.
    fn kind_of_value(&self, call: usize, from: usize, to: usize) -> Kind {
        if let Some(kind) = (from..to)
            .find(|&j| self.ident(j).is_some_and(|s| s != "self" && s != "mut"))
            .and_then(|j| {
                // `Gauge::default()`, `Counter::default()` inline.
                self.is(j + 1, "::")
                    .then(|| self.kind_in(j, j + 1))
                    .flatten()
            })
        {
            return kind;
        }
        let var = (from..to)
            .filter_map(|j| self.ident(j))
            .find(|s| *s != "self" && *s != "mut")
            .unwrap_or_else(|| panic!("{}: a metric value this test cannot read", self.at(call)));
        // The nearest `let var` before the call.
        if let Some(k) = (0..call).rev().find(|&k| {
            self.is(k, "let")
                && (self.ident(k + 1) == Some(var)
                    || (self.is(k + 1, "mut") && self.ident(k + 2) == Some(var)))
        }) {
            let end = self.statement_end(k);
            if let Some(kind) = self.kind_in(k, end) {
                return kind;
            }
        }
        // A field: `var: Type,` in a struct.
        if let Some(k) = (1..self.toks.len().saturating_sub(1)).find(|&k| {
            self.ident(k) == Some(var)
                && self.is(k + 1, ":")
                && (self.is(k - 1, "pub") || self.is(k - 1, "{") || self.is(k - 1, ","))
        }) {
            let mut end = k + 2;
            let mut angle = 0i32;
            while end < self.toks.len() {
                if self.is(end, "<") {
                    angle += 1;
                } else if self.is(end, ">") {
                    angle -= 1;
                } else if angle == 0 && (self.is(end, ",") || self.is(end, "}")) {
                    break;
                }
                end += 1;
            }
            if let Some(kind) = self.kind_in(k + 2, end) {
                return kind;
            }
        }
        panic!(
            "{}: the type of metric `{var}` is not a Gauge, Counter or Histogram this test can see",
            self.at(call)
        )
    }

    /// The innermost `fn` whose body holds `i`: its name and its parameters' names.
    fn enclosing_fn(&self, i: usize) -> Option<(String, Vec<String>)> {
        let mut best: Option<(usize, String, Vec<String>)> = None;
        for k in 0..i {
            if !self.is(k, "fn") {
                continue;
            }
            let Some(open) = (k..i).find(|&j| self.is(j, "(")) else {
                continue;
            };
            let close = self.close(open);
            let Some(body) = (close..self.toks.len()).find(|&j| self.is(j, "{") || self.is(j, ";"))
            else {
                continue;
            };
            if !self.is(body, "{") || body > i || self.close(body) < i {
                continue;
            }
            let params = self
                .items(open)
                .into_iter()
                .filter_map(|(s, e)| (s..e).filter_map(|j| self.ident(j)).find(|s| *s != "mut"))
                .map(String::from)
                .collect();
            let Some(name) = self.ident(k + 1) else {
                continue;
            };
            if best.as_ref().is_none_or(|(b, _, _)| body > *b) {
                best = Some((body, name.to_string(), params));
            }
        }
        best.map(|(_, name, params)| (name, params))
    }

    /// A closure `let [mut] NAME = |params| body;` whose body holds `i`: its name and parameters.
    fn closure(&self, i: usize) -> Option<(String, Vec<String>)> {
        for k in (2..i).rev() {
            if !(self.is(k, "=") && self.is(k + 1, "|")) {
                continue;
            }
            let name = if self.is(k - 2, "let") || self.is(k - 2, "mut") {
                self.ident(k - 1)?
            } else {
                continue;
            };
            let end_params = (k + 2..i).find(|&j| self.is(j, "|"))?;
            if self.statement_end(end_params) < i {
                return None;
            }
            let params = (k + 2..end_params)
                .filter_map(|j| self.ident(j))
                .filter(|s| *s != "mut")
                .map(String::from)
                .collect();
            return Some((name.to_string(), params));
        }
        None
    }

    /// The names a `for (…, var, …) in [tuples]` loop around `i` binds `var` to: the string
    /// literals at `var`'s place in each tuple of the array (inline, or a `let` array).
    fn loop_names(&self, i: usize, var: &str) -> Option<Vec<String>> {
        for k in (0..i).rev() {
            if !(self.is(k, "for") && self.is(k + 1, "(")) {
                continue;
            }
            let pattern = self.items(k + 1);
            let Some(place) = pattern
                .iter()
                .position(|&(s, e)| e == s + 1 && self.ident(s) == Some(var))
            else {
                continue;
            };
            let in_ = self.close(k + 1) + 1;
            assert!(
                self.is(in_, "in"),
                "{}: a for loop this test cannot read",
                self.at(k)
            );
            let Some(body) = (in_..self.toks.len()).find(|&j| self.is(j, "{")) else {
                continue;
            };
            if self.close(body) < i {
                continue;
            }
            let array = if self.is(in_ + 1, "[") {
                in_ + 1
            } else {
                let name = self.ident(in_ + 1)?;
                let let_ = (0..k)
                    .rev()
                    .find(|&j| self.is(j, "let") && self.ident(j + 1) == Some(name))?;
                (let_..k).find(|&j| self.is(j, "["))?
            };
            let names = self
                .items(array)
                .into_iter()
                .map(|(s, _)| {
                    assert!(self.is(s, "("), "{}: not an array of tuples", self.at(s));
                    let (es, ee) = self.items(s)[place];
                    match &self.toks[es].tok {
                        Tok::Str(name) if ee == es + 1 => name.clone(),
                        _ => panic!("{}: a metric name that is not a literal", self.at(es)),
                    }
                })
                .collect();
            return Some(names);
        }
        None
    }
}

/// A function or closure that registers a metric named by one of its parameters.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Helper {
    name: String,
    arity: usize,
    /// Which argument is the metric's name.
    place: usize,
    kind: Kind,
}

/// A registered metric.
#[derive(Clone, Debug)]
struct Registered {
    name: String,
    kind: Kind,
    at: String,
}

/// What a name argument (`from..to`) of a registration at `call` is.
enum NameArg {
    Names(Vec<String>),
    /// A parameter of the enclosing function or closure: that makes it a helper.
    Helper {
        name: String,
        arity: usize,
        place: usize,
    },
}

fn name_arg(src: &Source, call: usize, from: usize, to: usize) -> NameArg {
    if to == from + 1 {
        if let Tok::Str(s) = &src.toks[from].tok {
            return NameArg::Names(vec![s.clone()]);
        }
        if let Some(var) = src.ident(from) {
            if let Some((name, params)) = src.closure(call) {
                if let Some(place) = params.iter().position(|p| p == var) {
                    let arity = params.len();
                    return NameArg::Helper { name, arity, place };
                }
            }
            if let Some(names) = src.loop_names(call, var) {
                return NameArg::Names(names);
            }
            if let Some((name, params)) = src.enclosing_fn(call) {
                if let Some(place) = params.iter().position(|p| p == var) {
                    let arity = params.len();
                    return NameArg::Helper { name, arity, place };
                }
            }
        }
    }
    panic!(
        "{}: a metric name this test cannot read (a literal, a parameter, or a for-loop binding over literals)",
        src.at(call)
    )
}

/// Every metric registered in the workspace's crates' sources, with its full name (the
/// registry's prefix included) and kind, and the series names Prometheus stores.
fn registered() -> (Vec<Registered>, BTreeSet<String>) {
    let cargo = std::fs::read_to_string(format!("{ROOT}/Cargo.toml")).expect("Cargo.toml");
    let members = cargo
        .split_once("members = [")
        .and_then(|(_, r)| r.split_once(']'))
        .expect("the workspace's members")
        .0;
    let mut sources = Vec::new();
    for member in members
        .split(',')
        .map(|m| m.trim().trim_matches('"'))
        .filter(|m| !m.is_empty())
    {
        let mut stack = vec![PathBuf::from(format!("{ROOT}/{member}/src"))];
        while let Some(dir) = stack.pop() {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for e in entries.flatten() {
                let p = e.path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.extension().is_some_and(|x| x == "rs") {
                    let text = std::fs::read_to_string(&p).expect("a source file reads");
                    let path = p
                        .strip_prefix(format!("{ROOT}/"))
                        .unwrap_or(&p)
                        .display()
                        .to_string();
                    sources.push(Source {
                        path,
                        toks: lex(&text),
                    });
                }
            }
        }
    }
    assert!(sources.len() > 20, "{} source files", sources.len());

    // Passes until no new helper turns up: a registration through a parameter makes a helper,
    // whose calls are registrations in the next pass.
    let mut helpers: Vec<Helper> = Vec::new();
    loop {
        let mut found: Vec<Registered> = Vec::new();
        let mut new_helpers = Vec::new();
        for src in &sources {
            let mut prefixes = BTreeSet::new();
            for i in 0..src.toks.len() {
                for unread in [
                    "register_with_unit",
                    "register_collector",
                    "sub_registry_with_prefix",
                    "sub_registry_with_label",
                ] {
                    assert!(
                        src.ident(i) != Some(unread),
                        "{}: `{unread}`; teach this test what it exports",
                        src.at(i)
                    );
                }
                if matches!(src.ident(i), Some("with_prefix" | "with_prefix_and_labels"))
                    && src.is(i - 1, "::")
                    && src.is(i + 1, "(")
                {
                    match &src.toks[i + 2].tok {
                        Tok::Str(p) => prefixes.insert(p.clone()),
                        _ => panic!("{}: a registry prefix that is not a literal", src.at(i)),
                    };
                }
            }
            assert!(
                prefixes.len() <= 1,
                "{}: registries of several prefixes {prefixes:?}",
                src.path
            );
            let prefix = prefixes.into_iter().next();
            let full = |name: &str| match &prefix {
                Some(p) => format!("{p}_{name}"),
                None => name.to_string(),
            };
            for i in 1..src.toks.len().saturating_sub(1) {
                let Some(ident) = src.ident(i) else { continue };
                if !src.is(i + 1, "(") || src.is(i - 1, "fn") {
                    continue;
                }
                let register = ident == "register" && src.is(i - 1, ".");
                if !register && !helpers.iter().any(|h| h.name == ident) {
                    continue;
                }
                let args = src.items(i + 1);
                let (place, kind) = if register {
                    assert_eq!(args.len(), 3, "{}: register(name, help, metric)", src.at(i));
                    let (s, e) = args[2];
                    (0, src.kind_of_value(i, s, e))
                } else if let Some(h) = helpers
                    .iter()
                    .find(|h| h.name == ident && h.arity == args.len())
                {
                    (h.place, h.kind)
                } else {
                    continue;
                };
                let (s, e) = args[place];
                match name_arg(src, i, s, e) {
                    NameArg::Names(names) => found.extend(names.into_iter().map(|n| Registered {
                        name: full(&n),
                        kind,
                        at: src.at(i),
                    })),
                    NameArg::Helper { name, arity, place } => new_helpers.push(Helper {
                        name,
                        arity,
                        place,
                        kind,
                    }),
                }
            }
        }
        let before = helpers.len();
        for h in new_helpers {
            if !helpers.contains(&h) {
                helpers.push(h);
            }
        }
        if helpers.len() == before {
            let series = found.iter().flat_map(|r| r.kind.series(&r.name)).collect();
            return (found, series);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The metric names a PromQL expression reads.
// ---------------------------------------------------------------------------------------------

/// The metric names of a PromQL expression (or of Grafana's `label_values(expr, label)`):
/// identifiers outside label matchers, strings and ranges that are not functions,
/// aggregations, keywords or the label lists of `by`/`without`/`on`/`ignoring`/`group_*`.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut e = expr.trim();
    if let Some(inner) = e
        .strip_prefix("label_values(")
        .and_then(|r| r.strip_suffix(')'))
    {
        e = inner.rsplit_once(',').map_or(inner, |(m, _)| m);
    }
    let c: Vec<char> = e.chars().collect();
    let (mut i, mut names) = (0, BTreeSet::new());
    let skip_to = |i: usize, close: char| {
        let mut j = i + 1;
        while j < c.len() && c[j] != close {
            if c[j] == '"' || c[j] == '\'' || c[j] == '`' {
                let q = c[j];
                j += 1;
                while j < c.len() && c[j] != q {
                    j += if c[j] == '\\' { 2 } else { 1 };
                }
            }
            j += 1;
        }
        j + 1
    };
    let ident_start = |ch: char| ch.is_ascii_alphabetic() || ch == '_' || ch == ':';
    let ident_char = |ch: char| ch.is_ascii_alphanumeric() || ch == '_' || ch == ':';
    while i < c.len() {
        let ch = c[i];
        if ch == '{' {
            i = skip_to(i, '}');
        } else if ch == '[' {
            i = skip_to(i, ']');
        } else if ch == '"' || ch == '\'' || ch == '`' {
            i = skip_to(i, ch);
        } else if ch.is_ascii_digit() || ch == '.' {
            while i < c.len() && (c[i].is_ascii_alphanumeric() || c[i] == '.') {
                i += 1;
            }
        } else if ch == '$' {
            i += 1;
            while i < c.len() && ident_char(c[i]) {
                i += 1;
            }
        } else if ident_start(ch) {
            let s = i;
            while i < c.len() && ident_char(c[i]) {
                i += 1;
            }
            let word: String = c[s..i].iter().collect();
            let mut j = i;
            while j < c.len() && c[j].is_whitespace() {
                j += 1;
            }
            let called = c.get(j) == Some(&'(');
            match word.as_str() {
                "by" | "without" | "on" | "ignoring" | "group_left" | "group_right" => {
                    if called {
                        i = skip_to(j, ')');
                    }
                }
                // Keywords, and aggregations (`max by (l) (x)` puts no `(` after `max`).
                "bool" | "offset" | "and" | "or" | "unless" | "atan2" | "sum" | "min" | "max"
                | "avg" | "group" | "stddev" | "stdvar" | "count" | "count_values" | "bottomk"
                | "topk" | "quantile" | "limitk" | "limit_ratio" => {}
                _ if called => {}
                _ => {
                    names.insert(word);
                }
            }
        } else {
            i += 1;
        }
    }
    names
}

/// Every panel of a dashboard, those in rows' `panels` too.
fn all_panels(dashboard: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    for p in dashboard["panels"].as_array().into_iter().flatten() {
        out.push(p);
        out.extend(p["panels"].as_array().into_iter().flatten());
    }
    out
}

fn dashboard_file() -> Value {
    let path = format!("{ROOT}/{DASHBOARD}");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path} is not JSON: {e}"))
}

#[test]
fn the_test_reads_promql_as_prometheus_does() {
    let names = |e: &str| metric_names(e).into_iter().collect::<Vec<_>>();
    assert_eq!(
        names(
            r#"sum by (namespace, run) (rate(vllm:generation_tokens_total{namespace=~"$namespace", run=~"a|b"}[$__rate_interval])) / max by (namespace, run) (moult_router_engines{x="y"} > 0)"#
        ),
        ["moult_router_engines", "vllm:generation_tokens_total"]
    );
    assert_eq!(
        names("histogram_quantile(0.99, sum by (le) (rate(a_bucket[5m]))) * on (run) group_left (phase) b == bool 1 offset 5m"),
        ["a_bucket", "b"]
    );
    assert_eq!(
        names(r#"label_values(moult_operator_run_phase{namespace=~"$namespace"}, run)"#),
        ["moult_operator_run_phase"]
    );
    assert_eq!(names("1e3 * x and y unless z"), ["x", "y", "z"]);
    assert_eq!(
        names("count without (pod) (x) + sum(y) by (l) / max by (a) (z)"),
        ["x", "y", "z"]
    );
}

#[test]
fn the_test_reads_the_operators_metrics_as_prometheus_client_encodes_them() {
    // The parser against the real encoder, on the operator's registry (whose prefix it must
    // apply): the TYPE lines name every family, even empty ones.
    let (registered, _) = registered();
    let parsed: BTreeSet<String> = registered
        .iter()
        .filter(|r| r.at.starts_with("operator/src/controller/metrics.rs:"))
        .flat_map(|r| r.kind.series(&r.name))
        .collect();
    let text = moult_operator::controller::metrics::Metrics::default().encode();
    let encoded: BTreeSet<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .flat_map(|l| {
            let (name, kind) = l.split_once(' ').expect("# TYPE name kind");
            let kind = match kind {
                "gauge" => Kind::Gauge,
                "counter" => Kind::Counter,
                "histogram" => Kind::Histogram,
                other => panic!("a {other} in the operator's metrics"),
            };
            kind.series(name)
        })
        .collect();
    assert!(encoded.contains("moult_operator_run_gpu_seconds"), "{text}");
    assert_eq!(
        parsed, encoded,
        "the parsed operator metrics against its /metrics:\n{text}"
    );
}

#[test]
fn the_dashboards_queries_read_only_metrics_the_components_export() {
    let (registered, exported) = registered();
    // Every role's registrations were found (a parser that finds none would pass nothing).
    for prefix in [
        "moult_operator_",
        "moult_router_",
        "moult_trainer_",
        "moult_agents_",
        "moult_step",
        "vllm:",
    ] {
        assert!(
            registered.iter().any(|r| r.name.starts_with(prefix)),
            "no registered metric starts with {prefix}: {registered:#?}"
        );
    }
    let dashboard = dashboard_file();
    assert!(dashboard["uid"].is_string() && dashboard["title"].is_string());
    // (panel, expression, whether it is about runs: every panel but the operator's own row's).
    let mut queries: Vec<(String, String, bool)> = Vec::new();
    let mut ids = BTreeSet::new();
    let mut row = String::new();
    for panel in all_panels(&dashboard) {
        let title = panel["title"].as_str().unwrap_or("?").to_string();
        assert!(
            ids.insert(panel["id"].as_i64().expect("a panel id")),
            "panel ids repeat: {title}"
        );
        let g = &panel["gridPos"];
        let (x, w) = (g["x"].as_i64().unwrap(), g["w"].as_i64().unwrap());
        assert!(x >= 0 && w > 0 && x + w <= 24, "{title}: gridPos {g}");
        if panel["type"] == "row" {
            row = title;
            continue;
        }
        let targets = panel["targets"].as_array().filter(|t| !t.is_empty());
        let targets = targets.unwrap_or_else(|| panic!("panel {title} has no query"));
        for t in targets {
            let expr = t["expr"]
                .as_str()
                .unwrap_or_else(|| panic!("{title}: a target without expr"));
            assert_eq!(t["datasource"]["uid"], "${datasource}", "{title}");
            queries.push((title.clone(), expr.to_string(), row != "Operator"));
        }
    }
    let mut variables = BTreeSet::new();
    for v in dashboard["templating"]["list"]
        .as_array()
        .expect("templating")
    {
        variables.insert(v["name"].as_str().unwrap().to_string());
        if v["type"] == "query" {
            let q = v["query"]["query"]
                .as_str()
                .or(v["query"].as_str())
                .expect("a variable query");
            queries.push((format!("variable {}", v["name"]), q.to_string(), false));
        }
    }
    for v in ["datasource", "namespace", "run"] {
        assert!(variables.contains(v), "no ${v} variable: {variables:?}");
    }
    assert!(queries.len() > 20, "{} queries", queries.len());
    let mut unknown = Vec::new();
    let mut used = BTreeSet::new();
    for (title, expr, about_runs) in &queries {
        let names = metric_names(expr);
        assert!(!names.is_empty(), "{title}: `{expr}` reads no metric");
        for n in names {
            if !exported.contains(&n) {
                unknown.push(format!("{title}: {n} (in `{expr}`)"));
            }
            used.insert(n);
        }
        if *about_runs {
            // Run panels follow the variables.
            assert!(
                expr.contains("$run") && expr.contains("$namespace"),
                "{title}: `{expr}`"
            );
        }
    }
    assert!(
        unknown.is_empty(),
        "the dashboard reads metrics nothing exports:\n  {}\nexported: {exported:#?}",
        unknown.join("\n  ")
    );
    eprintln!(
        "the dashboard reads {} metrics, all exported: {used:?}",
        used.len()
    );
}

// ---------------------------------------------------------------------------------------------
// helm template.
// ---------------------------------------------------------------------------------------------

/// The test control plane's `helm` (what `scripts/cluster-build.sh` built).
fn helm_binary() -> PathBuf {
    let bin = match std::env::var_os("MOULT_K8S_BIN") {
        Some(bin) => PathBuf::from(bin),
        None => {
            let out = Command::new("bash")
                .arg(format!("{ROOT}/scripts/test-cluster.sh"))
                .arg("env")
                .output()
                .expect("bash runs");
            assert!(
                out.status.success(),
                "scripts/test-cluster.sh env: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let env = String::from_utf8_lossy(&out.stdout).into_owned();
            let bin = env
                .lines()
                .find_map(|l| l.strip_prefix("export MOULT_K8S_BIN="));
            PathBuf::from(bin.expect("MOULT_K8S_BIN in scripts/test-cluster.sh env"))
        }
    };
    let helm = bin.join("helm");
    assert!(
        helm.exists(),
        "{} does not exist; build it with `bash scripts/cluster-build.sh`",
        helm.display()
    );
    helm
}

/// The documents `helm template moult CHART -n moult-system ARGS` renders, as JSON.
fn template(args: &[&str]) -> Vec<Value> {
    use serde::Deserialize;
    let out = Command::new(helm_binary())
        .args([
            "template",
            "moult",
            &format!("{ROOT}/{CHART}"),
            "-n",
            "moult-system",
        ])
        .args(args)
        .output()
        .expect("helm runs");
    assert!(
        out.status.success(),
        "helm template {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("UTF-8");
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| {
            Value::deserialize(doc)
                .unwrap_or_else(|e| panic!("helm's output is not YAML: {e}\n{text}"))
        })
        .filter(|v| !v.is_null())
        .collect()
}

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

fn one<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    let found = of_kind(docs, kind);
    assert_eq!(found.len(), 1, "{kind}s: {found:#?}");
    found[0]
}

fn labels(v: &Value) -> BTreeMap<String, String> {
    v.as_object()
        .into_iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.as_str().expect("a string label").to_string()))
        .collect()
}

/// Whether a Kubernetes label selector (matchLabels, matchExpressions) selects `labels`.
fn selects(selector: &Value, labels: &BTreeMap<String, String>) -> bool {
    let by_labels = selector["matchLabels"]
        .as_object()
        .into_iter()
        .flatten()
        .all(|(k, v)| labels.get(k).map(String::as_str) == v.as_str());
    let by_expressions = selector["matchExpressions"]
        .as_array()
        .into_iter()
        .flatten()
        .all(|e| {
            let key = e["key"].as_str().expect("a key");
            let values: Vec<&str> = e["values"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|v| v.as_str())
                .collect();
            match e["operator"].as_str().expect("an operator") {
                "Exists" => labels.contains_key(key),
                "DoesNotExist" => !labels.contains_key(key),
                "In" => labels
                    .get(key)
                    .is_some_and(|v| values.contains(&v.as_str())),
                "NotIn" => labels
                    .get(key)
                    .is_none_or(|v| !values.contains(&v.as_str())),
                other => panic!("operator {other}"),
            }
        });
    by_labels && by_expressions
}

/// The port a container of the operator's pods serves `/metrics` on: every listening `moult`
/// role serves it, on `--metrics-addr` (trainer, agents) or else on its API port `--port`
/// (coordinator, `moult engine`, and `moult engine-front`, which passes vLLM's through). vLLM
/// itself listens on the loopback only, and `moult sandbox` serves no metrics.
fn metrics_port(c: &Value) -> Option<i64> {
    let command = c["command"].as_array()?;
    let program = command.first()?.as_str()?;
    if Path::new(program).file_name()? != "moult" {
        return None;
    }
    let args: Vec<&str> = c["args"]
        .as_array()?
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    let after = |flag: &str| {
        args.iter()
            .position(|a| *a == flag)
            .and_then(|p| args.get(p + 1))
    };
    let port = match after("--metrics-addr") {
        Some(addr) => addr.rsplit_once(':')?.1,
        None => after("--port")?,
    };
    Some(port.parse().expect("a port number"))
}

/// The pod templates of every kind of run (and of a judged run, when the operator builds one):
/// what they are, their labels and their containers.
fn run_pods() -> Vec<(String, BTreeMap<String, String>, Vec<Value>)> {
    let mut runs = run_kinds();
    let judged = std::fs::read_to_string(format!("{ROOT}/examples/judge/rlrun.yaml"))
        .expect("the judge example");
    runs.push(("judge example".into(), support::runs::parse(&judged)));
    let mut pods = Vec::new();
    for (kind, run) in runs {
        let Ok(c) = desired(&run, &Config::default(), "token") else {
            assert_eq!(kind, "judge example", "{kind} does not build");
            continue;
        };
        let Children {
            engines,
            trainer,
            coordinator,
            agents,
            judge,
            teacher,
            sandbox,
            ..
        } = c;
        let mut templates = vec![
            (
                "engine",
                serde_json::to_value(&engines.expect("a run of its own engines").spec.template)
                    .unwrap(),
            ),
            (
                "trainer",
                serde_json::to_value(&trainer.spec.template).unwrap(),
            ),
            (
                "coordinator",
                serde_json::to_value(&coordinator.spec.template).unwrap(),
            ),
            (
                "agents",
                serde_json::to_value(&agents.spec.template).unwrap(),
            ),
        ];
        if let Some(j) = judge {
            templates.push(("judge", serde_json::to_value(&j.spec.template).unwrap()));
        }
        if let Some(t) = teacher {
            templates.push(("teacher", serde_json::to_value(&t.spec.template).unwrap()));
        }
        if let Some(s) = sandbox {
            templates.push(("sandbox", s.template["spec"]["podTemplate"].clone()));
        }
        for (component, t) in templates {
            let containers = t["spec"]["containers"]
                .as_array()
                .expect("containers")
                .clone();
            pods.push((
                format!("{kind}: {component}"),
                labels(&t["metadata"]["labels"]),
                containers,
            ));
        }
    }
    pods
}

#[test]
#[ignore = "needs the test control plane's helm: bash scripts/cluster-build.sh (scripts/test.sh runs it)"]
fn cluster_helm_template_renders_the_servicemonitor_podmonitor_and_dashboard() {
    // Off by default, and the existing metrics values work as before.
    let plain = template(&["--set", "metrics.port=9100"]);
    for kind in ["ServiceMonitor", "PodMonitor", "ConfigMap"] {
        assert!(of_kind(&plain, kind).is_empty(), "a {kind} by default");
    }
    let service = one(&plain, "Service");
    assert_eq!(
        service["metadata"]["annotations"]["prometheus.io/port"],
        "9100"
    );
    assert_eq!(service["spec"]["ports"][0]["port"], 9100);

    let docs = template(&[
        "--set",
        "monitoring.serviceMonitor.enabled=true",
        "--set",
        "monitoring.serviceMonitor.labels.release=kube-prometheus-stack",
        "--set",
        "monitoring.podMonitor.enabled=true",
        "--set",
        "monitoring.podMonitor.interval=15s",
        "--set",
        "monitoring.podMonitor.labels.release=kube-prometheus-stack",
        "--set",
        "monitoring.dashboard.enabled=true",
        "--set",
        "monitoring.dashboard.annotations.grafana_folder=RL",
    ]);

    // The ServiceMonitor selects the operator's metrics Service, and its port by name.
    let sm = one(&docs, "ServiceMonitor");
    assert_eq!(sm["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(sm["metadata"]["namespace"], "moult-system");
    assert_eq!(sm["metadata"]["labels"]["release"], "kube-prometheus-stack");
    assert_eq!(
        sm["spec"]["namespaceSelector"],
        json!({"matchNames": ["moult-system"]})
    );
    let service = one(&docs, "Service");
    assert!(
        selects(
            &sm["spec"]["selector"],
            &labels(&service["metadata"]["labels"])
        ),
        "{sm:#}\n{service:#}"
    );
    let endpoints = sm["spec"]["endpoints"].as_array().expect("endpoints");
    assert_eq!(endpoints.len(), 1);
    let port = endpoints[0]["port"].as_str().expect("a port name");
    assert!(
        service["spec"]["ports"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["name"] == port),
        "the Service has no port {port}: {service:#}"
    );
    assert_eq!(endpoints[0]["path"], "/metrics");
    assert_eq!(endpoints[0]["interval"], "30s");
    // The run series' own namespace and run labels win over the target's.
    assert_eq!(endpoints[0]["honorLabels"], true);
    // Only the Service: the operator's pods are not run pods either.
    let deployment = one(&docs, "Deployment");
    let operator_pod = labels(&deployment["spec"]["template"]["metadata"]["labels"]);

    // The PodMonitor selects every run's pods, in any namespace, and no others.
    let pm = one(&docs, "PodMonitor");
    assert_eq!(pm["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(pm["metadata"]["labels"]["release"], "kube-prometheus-stack");
    assert_eq!(pm["spec"]["namespaceSelector"], json!({"any": true}));
    let selector = &pm["spec"]["selector"];
    assert_eq!(selector["matchLabels"][MANAGED_BY_LABEL], MANAGED_BY);
    assert!(
        !selects(selector, &operator_pod),
        "the operator's pods: {operator_pod:?}"
    );
    let endpoints = pm["spec"]["podMetricsEndpoints"]
        .as_array()
        .expect("podMetricsEndpoints");
    let mut scraped: HashMap<String, usize> = HashMap::new();
    let label = |l: &str| {
        format!(
            "__meta_kubernetes_pod_label_{}",
            l.replace(|c: char| !c.is_ascii_alphanumeric(), "_")
        )
    };
    for e in endpoints {
        let port = e["port"]
            .as_str()
            .expect("endpoints scrape named ports")
            .to_string();
        assert_eq!(e["path"], "/metrics", "{port}");
        assert_eq!(e["interval"], "15s", "{port}");
        let relabel: BTreeMap<String, String> = e["relabelings"]
            .as_array()
            .expect("relabelings")
            .iter()
            .map(|r| {
                (
                    r["targetLabel"].as_str().unwrap().to_string(),
                    r["sourceLabels"][0].as_str().unwrap().to_string(),
                )
            })
            .collect();
        assert_eq!(
            relabel["namespace"], "__meta_kubernetes_namespace",
            "{port}"
        );
        assert_eq!(relabel["run"], label(RUN_LABEL), "{port}");
        assert_eq!(relabel["component"], label(COMPONENT_LABEL), "{port}");
        scraped.insert(port, 0);
    }
    let mut components = BTreeSet::new();
    let pods = run_pods();
    assert!(pods.len() > 50, "{} pods", pods.len());
    for (what, pod_labels, containers) in &pods {
        assert!(
            selects(selector, pod_labels),
            "{what}: the PodMonitor does not select {pod_labels:?}"
        );
        for c in containers {
            let Some(port) = metrics_port(c) else {
                continue;
            };
            let name = c["ports"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|p| p["containerPort"] == port)
                .unwrap_or_else(|| {
                    panic!(
                        "{what}: container {} serves /metrics on {port}, which it does not declare",
                        c["name"]
                    )
                })
                .get("name")
                .and_then(Value::as_str)
                .unwrap_or_else(|| {
                    panic!(
                        "{what}: container {} serves /metrics on port {port}, which has no name",
                        c["name"]
                    )
                });
            let count = scraped.get_mut(name).unwrap_or_else(|| {
                panic!(
                    "{what}: the PodMonitor does not scrape port {name} (container {})",
                    c["name"]
                )
            });
            *count += 1;
            components.insert(pod_labels[COMPONENT_LABEL].clone());
        }
    }
    for component in ["engine", "trainer", "coordinator", "agents", "teacher"] {
        assert!(
            components.contains(component),
            "no {component} pod serves /metrics: {components:?}"
        );
    }
    for (port, count) in &scraped {
        assert!(
            *count > 0,
            "the PodMonitor scrapes port {port}, which no run pod serves /metrics on"
        );
    }
    eprintln!("scraped ports, by containers: {scraped:?}; components {components:?}");

    // The dashboard's ConfigMap, for the sidecar, holds the chart's dashboard file.
    let cm = of_kind(&docs, "ConfigMap");
    assert_eq!(cm.len(), 1, "{cm:#?}");
    let cm = cm[0];
    assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
    assert_eq!(cm["metadata"]["annotations"]["grafana_folder"], "RL");
    let data = cm["data"].as_object().expect("data");
    assert_eq!(data.len(), 1);
    let (key, text) = data.iter().next().unwrap();
    assert!(key.ends_with(".json"), "{key}");
    let rendered: Value =
        serde_json::from_str(text.as_str().unwrap()).expect("the dashboard JSON parses");
    assert_eq!(rendered, dashboard_file());

    // A namespaced install scrapes the watched namespaces; the monitors can live elsewhere.
    let docs = template(&[
        "--set",
        "watchNamespaces={team-a,team-b}",
        "--set",
        "monitoring.podMonitor.enabled=true",
        "--set",
        "monitoring.serviceMonitor.enabled=true",
        "--set",
        "monitoring.serviceMonitor.namespace=monitoring",
        "--set",
        "monitoring.dashboard.enabled=true",
        "--set",
        "monitoring.dashboard.labels.grafana_dashboard=moult",
    ]);
    let pm = one(&docs, "PodMonitor");
    assert_eq!(
        pm["spec"]["namespaceSelector"],
        json!({"matchNames": ["team-a", "team-b"]})
    );
    let sm = one(&docs, "ServiceMonitor");
    assert_eq!(sm["metadata"]["namespace"], "monitoring");
    assert_eq!(
        sm["spec"]["namespaceSelector"],
        json!({"matchNames": ["moult-system"]})
    );
    let cm = of_kind(&docs, "ConfigMap");
    assert_eq!(cm[0]["metadata"]["labels"]["grafana_dashboard"], "moult");

    // docs/monitoring.md's values file renders all three, and the scrapers' NetworkPolicy peers.
    let doc = std::fs::read_to_string(format!("{ROOT}/docs/monitoring.md")).expect("the page");
    let values = doc
        .split("```yaml\n")
        .skip(1)
        .find(|b| b.starts_with("# monitoring-values.yaml"))
        .and_then(|b| b.split_once("```").map(|(v, _)| v))
        .expect("docs/monitoring.md's values file");
    let path = std::env::temp_dir().join(format!(
        "moult-monitoring-values-{}.yaml",
        std::process::id()
    ));
    std::fs::write(&path, values).expect("the values file writes");
    let docs = template(&["-f", path.to_str().unwrap()]);
    let _ = std::fs::remove_file(&path);
    for kind in ["ServiceMonitor", "PodMonitor"] {
        assert_eq!(
            one(&docs, kind)["metadata"]["labels"]["release"],
            "kube-prometheus-stack"
        );
    }
    let cm = one(&docs, "ConfigMap");
    assert_eq!(cm["metadata"]["namespace"], "monitoring");
    let args =
        one(&docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"].to_string();
    assert!(args.contains("--metrics-from="), "{args}");
}
