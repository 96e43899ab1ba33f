//! The house as a newcomer sees it, read from the source tree: no import circle between the files
//! of one crate, no source file too long to read (and the binary's command files short, since they
//! are argument glue), libtorch only where it belongs, and every crate's `lib.rs` re-exporting by
//! name.
//!
//! An import circle is a loop of files each of which uses an item defined in the next, through
//! `crate::`, `super::`, `self::` or a child module's path, in a `use` or in code. A name is
//! followed through re-exports to the file that defines it, so a `lib.rs` or parent module that
//! re-exports its children (`pub use child::Item`) is a table of contents, not a user of them.
//! Code under `#[cfg(test)]` is left out: a unit test may drive its module through the crate's
//! higher-level functions.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// No source file is longer than this (tests and generated code aside).
const MAX_LINES: usize = 800;
/// The binary's command files are argument glue.
const MAX_CLI_LINES: usize = 300;
const CLI_DIR: &str = "src/cli";
/// The packages (directories relative to the workspace root) that may depend on libtorch.
const MAY_DEPEND_ON_LIBTORCH: [&str; 2] = [".", "crates/train"];
const LIBTORCH: [&str; 2] = ["tch", "torch-sys"];

fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The workspace's packages, as directories relative to the root: the root package, every crate
/// under `crates/`, and `xtask`.
fn packages(root: &Path) -> Vec<String> {
    let mut packages = vec![".".to_string()];
    let mut crates: Vec<String> = std::fs::read_dir(root.join("crates"))
        .expect("crates/ lists")
        .map(|entry| entry.expect("a crates/ entry").path())
        .filter(|path| path.join("Cargo.toml").is_file())
        .map(|path| format!("crates/{}", path.file_name().unwrap().to_string_lossy()))
        .collect();
    crates.sort();
    packages.extend(crates);
    if root.join("xtask/Cargo.toml").is_file() {
        packages.push("xtask".into());
    }
    packages
}

/// Every `.rs` file under `dir`, recursively, relative to `root`, `/`-separated.
fn rust_files(root: &Path, dir: &Path, out: &mut Vec<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries {
        let path = entry.expect("a directory entry").path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if path.is_dir() {
            if !name.starts_with('.') && name != "target" {
                rust_files(root, &path, out);
            }
        } else if name.ends_with(".rs") {
            out.push(path.strip_prefix(root).unwrap().to_string_lossy().replace('\\', "/"));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// A small reader of Rust source: tokens without comments, strings or literals.

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Ident(String),
    /// `::`
    Path,
    Punct(char),
    /// A string literal's text (kept for `#[path = "..."]`).
    Str(String),
}

fn tokens(source: &str) -> Vec<Token> {
    let chars: Vec<char> = source.chars().collect();
    let (mut out, mut i) = (Vec::new(), 0);
    let ident_char = |c: char| c.is_alphanumeric() || c == '_';
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c.is_whitespace() {
            i += 1;
        } else if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if (c == 'r' || c == 'b') && raw_string_start(&chars, i).is_some() {
            let (hashes, body) = raw_string_start(&chars, i).unwrap();
            let mut j = body;
            let text_start = j;
            loop {
                if j >= chars.len() {
                    break;
                }
                if chars[j] == '"' && (0..hashes).all(|k| chars.get(j + 1 + k) == Some(&'#')) {
                    break;
                }
                j += 1;
            }
            out.push(Token::Str(chars[text_start..j.min(chars.len())].iter().collect()));
            i = j + 1 + hashes;
        } else if c == '"' || (c == 'b' && next == Some('"')) {
            let mut j = if c == 'b' { i + 2 } else { i + 1 };
            let text_start = j;
            while j < chars.len() && chars[j] != '"' {
                j += if chars[j] == '\\' { 2 } else { 1 };
            }
            out.push(Token::Str(chars[text_start..j.min(chars.len())].iter().collect()));
            i = j + 1;
        } else if c == '\'' || (c == 'b' && next == Some('\'')) {
            // A char literal ('x', '\n', '\u{1F600}', b'x') or a lifetime ('a).
            let start = if c == 'b' { i + 1 } else { i };
            if chars.get(start + 1) == Some(&'\\') {
                let mut j = start + 2;
                while j < chars.len() && chars[j] != '\'' {
                    j += 1;
                }
                i = j + 1;
            } else if chars.get(start + 2) == Some(&'\'') {
                i = start + 3;
            } else {
                i = start + 1; // a lifetime: its name follows as an identifier
            }
        } else if ident_char(c) {
            let mut j = i;
            while j < chars.len() && ident_char(chars[j]) {
                j += 1;
            }
            let word: String = chars[i..j].iter().collect();
            let word = word.strip_prefix("r#").map(str::to_string).unwrap_or(word);
            out.push(Token::Ident(word));
            i = j;
        } else if c == ':' && next == Some(':') {
            out.push(Token::Path);
            i += 2;
        } else {
            out.push(Token::Punct(c));
            i += 1;
        }
    }
    out
}

/// `r"`, `r#"`, `br"`, `br#"` at `i`: the number of hashes and where the text starts.
fn raw_string_start(chars: &[char], i: usize) -> Option<(usize, usize)> {
    if i > 0 && (chars[i - 1].is_alphanumeric() || chars[i - 1] == '_') {
        return None;
    }
    let mut j = i;
    if chars.get(j) == Some(&'b') {
        j += 1;
    }
    if chars.get(j) != Some(&'r') {
        return None;
    }
    j += 1;
    let mut hashes = 0;
    while chars.get(j) == Some(&'#') {
        hashes += 1;
        j += 1;
    }
    (chars.get(j) == Some(&'"')).then_some((hashes, j + 1))
}

// ---------------------------------------------------------------------------------------------
// The module tree of one crate and the paths each file names.

/// One `use` leaf: the name it brings in (None for a glob), the path it names, and whether it is
/// visible outside its module (a re-export).
#[derive(Debug, Clone)]
struct UseLeaf {
    name: Option<String>,
    target: Vec<String>,
    public: bool,
}

#[derive(Debug, Default)]
struct Module {
    file: String,
    /// `use` declarations outside `#[cfg(test)]`.
    uses: Vec<UseLeaf>,
    /// Paths named in code outside `use` and `#[cfg(test)]`, made absolute.
    paths: Vec<Vec<String>>,
    /// Names of the items defined here (types, functions, constants, traits, macros).
    defs: BTreeSet<String>,
}

/// A crate: its modules by absolute path (the root is `[]`), inline modules included.
#[derive(Debug, Default)]
struct Crate {
    modules: BTreeMap<Vec<String>, Module>,
}

fn read_crate(root: &Path, root_file: &str) -> Crate {
    let mut krate = Crate::default();
    let mut pending = vec![(Vec::<String>::new(), root_file.to_string(), true)];
    while let Some((module_path, file, owns_dir)) = pending.pop() {
        let source = std::fs::read_to_string(root.join(&file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        // A file's children live in its directory when it is `lib.rs`, `main.rs` or `mod.rs`,
        // else in the directory named after it.
        let file_dir = Path::new(&file).parent().unwrap().to_path_buf();
        let child_dir = if owns_dir { file_dir.clone() } else { file_dir.join(Path::new(&file).file_stem().unwrap()) };
        let mut reader = Reader {
            root: root.to_path_buf(),
            tokens: tokens(&source),
            at: 0,
            file: file.clone(),
            file_dir,
            child_dir,
            krate: &mut krate,
            children: Vec::new(),
        };
        reader.module(module_path.clone(), None);
        for (child_path, child_file, child_owns_dir) in reader.children {
            pending.push((child_path, child_file, child_owns_dir));
        }
    }
    krate
}

/// Keywords that introduce a named item of a module.
const ITEM_KEYWORDS: [&str; 9] = ["struct", "enum", "fn", "const", "static", "type", "trait", "union", "macro_rules"];

struct Reader<'a> {
    root: PathBuf,
    tokens: Vec<Token>,
    at: usize,
    file: String,
    file_dir: PathBuf,
    child_dir: PathBuf,
    krate: &'a mut Crate,
    /// Out-of-line modules declared in this file: (path, file, whether that file owns its dir).
    children: Vec<(Vec<String>, String, bool)>,
}

impl Reader<'_> {
    fn peek(&self, ahead: usize) -> Option<&Token> {
        self.tokens.get(self.at + ahead)
    }

    fn ident(&self, ahead: usize) -> Option<&str> {
        match self.peek(ahead) {
            Some(Token::Ident(word)) => Some(word),
            _ => None,
        }
    }

    fn punct(&self, ahead: usize, c: char) -> bool {
        self.peek(ahead) == Some(&Token::Punct(c))
    }

    /// Reads the items of module `path` up to its closing brace (or the file's end); `inline_dir`
    /// is where an inline module's out-of-line children live.
    fn module(&mut self, path: Vec<String>, inline_dir: Option<PathBuf>) {
        self.krate
            .modules
            .entry(path.clone())
            .or_insert_with(|| Module { file: self.file.clone(), ..Module::default() });
        let child_dir = inline_dir.unwrap_or_else(|| self.child_dir.clone());
        let (mut test_only, mut path_attr) = (false, None::<String>);
        let mut depth = 0usize;
        while let Some(token) = self.peek(0).cloned() {
            match token {
                Token::Punct('#') if self.punct(1, '[') || (self.punct(1, '!') && self.punct(2, '[')) => {
                    let (is_test, file_attr) = self.attribute();
                    test_only |= is_test;
                    path_attr = file_attr.or(path_attr);
                    continue;
                }
                Token::Punct('{') => depth += 1,
                Token::Punct('}') => {
                    if depth == 0 {
                        self.at += 1;
                        return;
                    }
                    depth -= 1;
                }
                Token::Punct(';') => {}
                _ if test_only => {
                    self.skip_item();
                    test_only = false;
                    continue;
                }
                Token::Ident(word) if word == "mod" && self.ident(1).is_some() => {
                    let name = self.ident(1).unwrap().to_string();
                    let mut child = path.clone();
                    child.push(name.clone());
                    if self.punct(2, ';') {
                        let (file, owns_dir) = match path_attr.take() {
                            Some(relative) => (self.file_dir.join(relative), true),
                            None if self.root.join(&child_dir).join(format!("{name}.rs")).is_file() => {
                                (child_dir.join(format!("{name}.rs")), false)
                            }
                            None => (child_dir.join(&name).join("mod.rs"), true),
                        };
                        let file = normalize(&file);
                        self.children.push((child, file, owns_dir));
                        self.at += 3;
                    } else if self.punct(2, '{') {
                        self.at += 3;
                        let inline_dir = child_dir.join(&name);
                        self.module(child, Some(inline_dir));
                    } else {
                        self.at += 1;
                    }
                    continue;
                }
                Token::Ident(word)
                    if depth == 0
                        && ITEM_KEYWORDS.contains(&word.as_str())
                        && (self.ident(1).is_some() || (word == "macro_rules" && self.punct(1, '!'))) =>
                {
                    let name = if word == "macro_rules" { self.ident(2) } else { self.ident(1) };
                    if let Some(name) = name.map(str::to_string) {
                        self.krate.modules.get_mut(&path).unwrap().defs.insert(name);
                    }
                    self.at += 1;
                    continue;
                }
                Token::Ident(word) if word == "use" => {
                    let public = self.is_public_before();
                    self.at += 1;
                    let mut leaves = Vec::new();
                    self.use_tree(&path, Vec::new(), &mut leaves);
                    let module = self.krate.modules.get_mut(&path).unwrap();
                    module.uses.extend(leaves.into_iter().map(|mut leaf| {
                        leaf.public = public;
                        leaf
                    }));
                    continue;
                }
                Token::Ident(word)
                    if (word == "crate" || word == "super" || word == "self")
                        && self.peek(1) == Some(&Token::Path)
                        && !(self.at > 0 && self.tokens[self.at - 1] == Token::Path) =>
                {
                    // `pub(in super::super)` restricts visibility; it names no item.
                    let visibility = self.at > 0 && self.tokens[self.at - 1] == Token::Ident("in".into());
                    let segments = self.path_segments();
                    if visibility {
                        continue;
                    }
                    if let Some(absolute) = absolute(&path, &segments) {
                        self.krate.modules.get_mut(&path).unwrap().paths.push(absolute);
                    }
                    continue;
                }
                Token::Ident(_)
                    if self.peek(1) == Some(&Token::Path)
                        && !(self.at > 0 && self.tokens[self.at - 1] == Token::Path) =>
                {
                    // A child module's path (`child::Item`); other leading names (std, a type,
                    // an extern crate) are resolved later only if a module of that name exists.
                    let segments = self.path_segments();
                    let mut absolute = path.clone();
                    absolute.extend(segments);
                    self.krate.modules.get_mut(&path).unwrap().paths.push(absolute);
                    continue;
                }
                _ => {}
            }
            test_only = false;
            self.at += 1;
        }
    }

    /// Whether the `use` at the cursor is preceded by `pub` or `pub(...)`.
    fn is_public_before(&self) -> bool {
        let mut j = self.at;
        if j >= 1 && self.tokens[j - 1] == Token::Punct(')') {
            while j > 0 && self.tokens[j - 1] != Token::Punct('(') {
                j -= 1;
            }
            j = j.saturating_sub(1);
        }
        j >= 1 && self.tokens[j - 1] == Token::Ident("pub".into())
    }

    /// Reads `#[...]` or `#![...]`: whether it is a `cfg` that holds only under test, and a
    /// `path = "..."` attribute's value.
    fn attribute(&mut self) -> (bool, Option<String>) {
        self.at += if self.punct(1, '!') { 2 } else { 1 };
        let start = self.at;
        let mut depth = 0;
        while let Some(token) = self.peek(0) {
            match token {
                Token::Punct('[') => depth += 1,
                Token::Punct(']') => {
                    depth -= 1;
                    if depth == 0 {
                        self.at += 1;
                        break;
                    }
                }
                _ => {}
            }
            self.at += 1;
        }
        let inner = &self.tokens[start..self.at];
        let words: Vec<&str> = inner
            .iter()
            .filter_map(|t| match t {
                Token::Ident(word) => Some(word.as_str()),
                _ => None,
            })
            .collect();
        let is_test = words.first() == Some(&"cfg") && words.contains(&"test") && !words.contains(&"not");
        let file = match (words.first(), inner.iter().find_map(|t| if let Token::Str(s) = t { Some(s) } else { None }))
        {
            (Some(&"path"), Some(value)) => Some(value.clone()),
            _ => None,
        };
        (is_test, file)
    }

    /// Skips one item: up to a `;` outside brackets or past its balanced `{...}` body.
    fn skip_item(&mut self) {
        let mut depth = 0i32;
        while let Some(token) = self.peek(0) {
            match token {
                Token::Punct('{') | Token::Punct('(') | Token::Punct('[') => depth += 1,
                Token::Punct('}') | Token::Punct(')') | Token::Punct(']') => {
                    depth -= 1;
                    if depth == 0 && token == &Token::Punct('}') {
                        self.at += 1;
                        return;
                    }
                    if depth < 0 {
                        return;
                    }
                }
                Token::Punct(';') if depth == 0 => {
                    self.at += 1;
                    return;
                }
                _ => {}
            }
            self.at += 1;
        }
    }

    /// Reads `a::b::c` from the cursor (stops before `::<` or anything else).
    fn path_segments(&mut self) -> Vec<String> {
        let mut segments = Vec::new();
        while let Some(word) = self.ident(0) {
            segments.push(word.to_string());
            self.at += 1;
            if self.peek(0) == Some(&Token::Path) && self.ident(1).is_some() {
                self.at += 1;
            } else {
                break;
            }
        }
        segments
    }

    /// Reads a use tree after `use` (or inside braces) into leaves with absolute targets.
    fn use_tree(&mut self, module: &[String], prefix: Vec<String>, leaves: &mut Vec<UseLeaf>) {
        let mut segments = prefix;
        loop {
            match self.peek(0).cloned() {
                Some(Token::Path) => self.at += 1,
                Some(Token::Ident(word)) if word == "as" => {
                    let alias = self.ident(1).map(str::to_string);
                    self.at += 2;
                    if let Some(leaf) = leaves.last_mut() {
                        leaf.name = alias;
                    }
                }
                Some(Token::Ident(word)) => {
                    self.at += 1;
                    let ends = self.peek(0) != Some(&Token::Path);
                    if word == "self" && ends && !segments.is_empty() {
                        if let Some(target) = absolute(module, &segments) {
                            leaves.push(UseLeaf { name: segments.last().cloned(), target, public: false });
                        }
                    } else {
                        segments.push(word.clone());
                        if ends {
                            if let Some(target) = absolute(module, &segments) {
                                leaves.push(UseLeaf { name: Some(word), target, public: false });
                            }
                        }
                    }
                }
                Some(Token::Punct('*')) => {
                    self.at += 1;
                    if let Some(target) = absolute(module, &segments) {
                        leaves.push(UseLeaf { name: None, target, public: false });
                    }
                }
                Some(Token::Punct('{')) => {
                    self.at += 1;
                    loop {
                        self.use_tree(module, segments.clone(), leaves);
                        match self.peek(0) {
                            Some(Token::Punct(',')) => self.at += 1,
                            Some(Token::Punct('}')) => {
                                self.at += 1;
                                break;
                            }
                            _ => break,
                        }
                        if self.punct(0, '}') {
                            self.at += 1;
                            break;
                        }
                    }
                }
                Some(Token::Punct(';')) => {
                    self.at += 1;
                    return;
                }
                _ => return,
            }
        }
    }
}

fn normalize(path: &Path) -> String {
    let mut parts: Vec<String> = Vec::new();
    for component in path.components() {
        match component {
            std::path::Component::ParentDir => {
                parts.pop();
            }
            std::path::Component::CurDir => {}
            other => parts.push(other.as_os_str().to_string_lossy().to_string()),
        }
    }
    parts.join("/")
}

/// `segments` (starting `crate`, `super`, `self` or a name) as a path from the crate root, seen
/// from `module`; a plain leading name stays relative to `module` (checked against the modules
/// when resolved).
fn absolute(module: &[String], segments: &[String]) -> Option<Vec<String>> {
    let mut out: Vec<String> = module.to_vec();
    let mut rest = segments;
    match segments.first().map(String::as_str) {
        Some("crate") => {
            out.clear();
            rest = &segments[1..];
        }
        Some("super") | Some("self") => {
            while let Some(word) = rest.first() {
                match word.as_str() {
                    "super" => {
                        out.pop()?;
                    }
                    "self" => {}
                    _ => break,
                }
                rest = &rest[1..];
            }
        }
        Some(_) => {}
        None => return None,
    }
    out.extend(rest.iter().cloned());
    Some(out)
}

impl Crate {
    /// The file that defines the item `path` names, following re-exports; None for a path
    /// outside the crate (or a name the module neither defines nor imports by name).
    fn defining_file(&self, path: &[String], hops: usize) -> Option<String> {
        let module_len = (0..=path.len()).rev().find(|&n| self.modules.contains_key(&path[..n]))?;
        let module = &self.modules[&path[..module_len]];
        let rest = &path[module_len..];
        let Some(name) = rest.first() else { return Some(module.file.clone()) };
        if hops < 16 {
            if let Some(leaf) = module.uses.iter().find(|u| u.name.as_deref() == Some(name)) {
                let mut target = leaf.target.clone();
                target.extend(rest[1..].iter().cloned());
                return self.defining_file(&target, hops + 1);
            }
        }
        if module.defs.contains(name) {
            return Some(module.file.clone());
        }
        // A glob import may bring the name in.
        module
            .uses
            .iter()
            .filter(|u| u.name.is_none() && hops < 16)
            .filter_map(|u| {
                let mut target = u.target.clone();
                target.extend(rest.iter().cloned());
                self.defining_file(&target, hops + 1)
            })
            .next()
    }

    /// Whether `path` (relative paths from a module are tried as written) starts with a module
    /// of this crate or a name the module imported.
    fn is_internal(&self, from: &[String], path: &[String]) -> bool {
        if path.len() <= from.len() || path[..from.len()] != *from {
            return true; // made absolute from crate/super/self
        }
        let first = &path[from.len()];
        let mut child = from.to_vec();
        child.push(first.clone());
        self.modules.contains_key(&child) || self.modules[from].uses.iter().any(|u| u.name.as_deref() == Some(first))
    }

    /// File-to-file uses, each with one path that makes it.
    fn edges(&self) -> BTreeMap<(String, String), String> {
        let mut edges = BTreeMap::new();
        for (module_path, module) in &self.modules {
            let mut named: Vec<(Vec<String>, bool)> = Vec::new();
            for leaf in &module.uses {
                // A re-export of the module's own descendants is a table of contents.
                let reexport = leaf.public;
                named.push((leaf.target.clone(), reexport));
            }
            for path in &module.paths {
                if self.is_internal(module_path, path) {
                    named.push((path.clone(), false));
                }
            }
            for (path, reexport) in named {
                let Some(file) = self.defining_file(&path, 0) else { continue };
                if file == module.file {
                    continue;
                }
                let defining_module = self.modules.iter().find(|(_, m)| m.file == file).map(|(p, _)| p.clone());
                let descendant = defining_module
                    .is_some_and(|p| p.len() > module_path.len() && p[..module_path.len()] == *module_path);
                if reexport && descendant {
                    continue;
                }
                edges.entry((module.file.clone(), file)).or_insert_with(|| path.join("::"));
            }
        }
        edges
    }
}

/// The import circles of one crate: each a set of files and the uses that close it.
fn circles(krate: &Crate) -> Vec<String> {
    let edges = krate.edges();
    let mut graph: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (from, to) in edges.keys() {
        graph.entry(from).or_default().push(to);
        graph.entry(to).or_default();
    }
    let mut found = Vec::new();
    for component in strongly_connected(&graph) {
        if component.len() < 2 {
            continue;
        }
        let members: BTreeSet<&str> = component.iter().copied().collect();
        let uses: Vec<String> = edges
            .iter()
            .filter(|((from, to), _)| members.contains(from.as_str()) && members.contains(to.as_str()))
            .map(|((from, to), example)| format!("    {from} -> {to} (`{example}`)"))
            .collect();
        found.push(format!("  {}\n{}", members.into_iter().collect::<Vec<_>>().join(", "), uses.join("\n")));
    }
    found
}

/// Tarjan's strongly connected components.
fn strongly_connected<'a>(graph: &BTreeMap<&'a str, Vec<&'a str>>) -> Vec<Vec<&'a str>> {
    struct State<'a> {
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        out: Vec<Vec<&'a str>>,
    }
    fn visit<'a>(node: &'a str, graph: &BTreeMap<&'a str, Vec<&'a str>>, s: &mut State<'a>) {
        let n = s.index.len();
        s.index.insert(node, n);
        s.low.insert(node, n);
        s.stack.push(node);
        s.on_stack.insert(node);
        for &next in &graph[node] {
            if !s.index.contains_key(next) {
                visit(next, graph, s);
                let low = s.low[node].min(s.low[next]);
                s.low.insert(node, low);
            } else if s.on_stack.contains(next) {
                let low = s.low[node].min(s.index[next]);
                s.low.insert(node, low);
            }
        }
        if s.low[node] == s.index[node] {
            let mut component = Vec::new();
            while let Some(top) = s.stack.pop() {
                s.on_stack.remove(top);
                component.push(top);
                if top == node {
                    break;
                }
            }
            s.out.push(component);
        }
    }
    let mut state = State {
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for &node in graph.keys() {
        if !state.index.contains_key(node) {
            visit(node, graph, &mut state);
        }
    }
    state.out
}

/// The crate roots of a package: `src/lib.rs`, `src/main.rs` and each `src/bin/*.rs`.
fn crate_roots(root: &Path, package: &str) -> Vec<String> {
    let base = if package == "." { String::new() } else { format!("{package}/") };
    let mut roots: Vec<String> = ["src/lib.rs", "src/main.rs"]
        .iter()
        .map(|file| format!("{base}{file}"))
        .filter(|file| root.join(file).is_file())
        .collect();
    if let Ok(entries) = std::fs::read_dir(root.join(format!("{base}src/bin"))) {
        let mut bins: Vec<String> = entries
            .map(|entry| entry.expect("a src/bin entry").path())
            .filter(|path| path.extension().is_some_and(|e| e == "rs"))
            .map(|path| path.strip_prefix(root).unwrap().to_string_lossy().replace('\\', "/"))
            .collect();
        bins.sort();
        roots.extend(bins);
    }
    roots
}

#[test]
fn no_import_circle_between_the_files_of_a_crate() {
    let root = workspace_root();
    let mut report = Vec::new();
    for package in packages(&root) {
        for crate_root in crate_roots(&root, &package) {
            for circle in circles(&read_crate(&root, &crate_root)) {
                report.push(format!("crate {crate_root}:\n{circle}"));
            }
        }
    }
    assert!(
        report.is_empty(),
        "files that import each other in a loop (move the shared item down):\n{}",
        report.join("\n")
    );
}

/// Test code and generated code may be long.
fn exempt_from_length(file: &str) -> bool {
    file.split('/').any(|part| part == "tests") || file.ends_with("/tests.rs") || file.starts_with("target/")
}

fn is_generated(source: &str) -> bool {
    source.lines().take(5).any(|line| line.contains("@generated"))
}

#[test]
fn no_source_file_is_too_long_to_read() {
    let root = workspace_root();
    let mut files = Vec::new();
    for package in packages(&root) {
        let dir = if package == "." { root.clone() } else { root.join(&package) };
        for sub in ["src", "benches", "examples"] {
            rust_files(&root, &dir.join(sub), &mut files);
        }
    }
    files.sort();
    let mut too_long = Vec::new();
    for file in files.iter().filter(|file| !exempt_from_length(file)) {
        let source = std::fs::read_to_string(root.join(file)).unwrap();
        if is_generated(&source) {
            continue;
        }
        let lines = source.lines().count();
        let limit = if file.starts_with(&format!("{CLI_DIR}/")) { MAX_CLI_LINES } else { MAX_LINES };
        if lines > limit {
            too_long.push(format!("  {file}: {lines} lines (at most {limit})"));
        }
    }
    assert!(
        too_long.is_empty(),
        "source files over their length limit (split by the question each part answers):\n{}",
        too_long.join("\n")
    );
}

#[test]
fn only_crates_train_and_the_binary_depend_on_libtorch() {
    let root = workspace_root();
    let mut wrong = Vec::new();
    for package in packages(&root) {
        let manifest = root.join(&package).join("Cargo.toml");
        let text = std::fs::read_to_string(&manifest).unwrap();
        let table: toml::Table = text.parse().unwrap_or_else(|e| panic!("{}: {e}", manifest.display()));
        let mut sections: Vec<(String, &toml::Value)> = Vec::new();
        for kind in ["dependencies", "build-dependencies"] {
            if let Some(deps) = table.get(kind) {
                sections.push((kind.to_string(), deps));
            }
        }
        if let Some(toml::Value::Table(targets)) = table.get("target") {
            for (target, spec) in targets {
                for kind in ["dependencies", "build-dependencies"] {
                    if let Some(deps) = spec.get(kind) {
                        sections.push((format!("target.{target}.{kind}"), deps));
                    }
                }
            }
        }
        for (section, deps) in sections {
            let Some(deps) = deps.as_table() else { continue };
            for name in LIBTORCH {
                if deps.contains_key(name) && !MAY_DEPEND_ON_LIBTORCH.contains(&package.as_str()) {
                    wrong.push(format!("  {package}/Cargo.toml [{section}] {name}"));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "only {MAY_DEPEND_ON_LIBTORCH:?} may depend on libtorch:\n{}", wrong.join("\n"));
}

#[test]
fn every_lib_rs_reexports_by_name() {
    let root = workspace_root();
    let mut globs = Vec::new();
    for package in packages(&root) {
        let lib = if package == "." { "src/lib.rs".to_string() } else { format!("{package}/src/lib.rs") };
        if !root.join(&lib).is_file() {
            continue;
        }
        let krate = read_crate(&root, &lib);
        for leaf in &krate.modules[&Vec::new()].uses {
            if leaf.public && leaf.name.is_none() {
                globs.push(format!("  {lib}: pub use {}::*", leaf.target.join("::")));
            }
        }
    }
    assert!(globs.is_empty(), "glob re-exports in a lib.rs (list the names):\n{}", globs.join("\n"));
}

/// The three documents keep their jobs: the guide short, the map short, the figures in the
/// results book.
const DOC_LIMITS: [(&str, usize); 2] = [("README.md", 300), ("ARCHITECTURE.md", 400)];

#[test]
fn the_guide_and_the_map_stay_short_and_name_files_that_exist() {
    let root = workspace_root();
    let mut wrong = Vec::new();
    for (doc, limit) in DOC_LIMITS {
        let text = std::fs::read_to_string(root.join(doc)).unwrap_or_else(|e| panic!("{doc}: {e}"));
        let lines = text.lines().count();
        if lines > limit {
            wrong.push(format!("  {doc}: {lines} lines (at most {limit})"));
        }
        // Every path in backticks that starts at the repository's top-level folders must exist,
        // so a moved file cannot leave the map pointing at nothing.
        for span in text.split('`').skip(1).step_by(2) {
            let path = span.trim_end_matches(',');
            let rooted = ["src/", "crates/", "tests/", "benches/", "xtask/", "scripts/", "dashboards/"]
                .iter()
                .any(|top| path.starts_with(top));
            let plain = path.chars().all(|c| c.is_ascii_alphanumeric() || "/_.-".contains(c));
            if rooted && plain && !root.join(path).exists() {
                wrong.push(format!("  {doc} names `{path}`, which does not exist"));
            }
        }
    }
    assert!(wrong.is_empty(), "documents out of step with the tree:\n{}", wrong.join("\n"));
}
