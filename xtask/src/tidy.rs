//! `cargo xtask tidy [--repo DIR]`: the repository's house rules, checked (the tests run it):
//! - every Rust file opens with a `//!` paragraph saying what it owns;
//! - no tracked file names a machine path (a home, work or temporary folder of one machine): paths
//!   come from arguments and `METRALE_*` variables;
//! - every `METRALE_*` name the code, scripts or tests use is in ARCHITECTURE.md's Configuration
//!   table, which says who reads it and what it changes;
//! - every CUDA entry point's signature is rendered from its ABI declaration
//!   (`{{{abi.params.<entry>}}}` in its template), so no kernel restates its parameters.
//!
//! Files are those git tracks or would track (`git ls-files --cached --others --exclude-standard`),
//! or, outside a git checkout, every file under the folder except build outputs; this file itself is
//! exempt from the path and name rules, which it must spell out. Exit status 1 with one line per
//! problem.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};

#[derive(clap::Args)]
pub struct Args {
    /// Source tree to check (default: this repository).
    #[arg(long)]
    pub repo: Option<PathBuf>,
}

/// Folders that are never sources (build outputs, caches, carried bundles).
const SKIP_DIRS: &[&str] = &[
    ".git",
    "target",
    "dist",
    ".toolchain",
    ".models",
    ".gpu",
    ".carry1",
    ".carry2",
    ".peer",
    ".whl",
    "__pycache__",
];

/// Repo-relative paths of the files to check.
fn files(repo: &Path) -> Result<Vec<String>> {
    let git = Command::new("git")
        .arg("-C")
        .arg(repo)
        .args([
            "ls-files",
            "-z",
            "--cached",
            "--others",
            "--exclude-standard",
        ])
        .output();
    if let Ok(o) = git {
        if o.status.success() && !o.stdout.is_empty() {
            return Ok(o
                .stdout
                .split(|&b| b == 0)
                .filter(|p| !p.is_empty())
                .map(|p| String::from_utf8_lossy(p).into_owned())
                .collect());
        }
    }
    let mut out = Vec::new();
    let mut stack = vec![repo.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
            let e = e?;
            let name = e.file_name().to_string_lossy().into_owned();
            let p = e.path();
            if p.is_dir() {
                if !SKIP_DIRS.contains(&name.as_str()) {
                    stack.push(p);
                }
            } else if let Ok(rel) = p.strip_prefix(repo) {
                out.push(rel.to_string_lossy().replace('\\', "/"));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// The machine path a line names, if any: a work or root folder, a user's home, or a named file or
/// folder in /tmp (a bare `/tmp/` is a place, not a machine's path).
fn machine_path(line: &str) -> Option<&'static str> {
    /// (what to find, how to name it, what the next character must be for it to count)
    type Pattern = (&'static str, &'static str, fn(char) -> bool);
    const PATTERNS: [Pattern; 4] = [
        ("/work/", "/work/", |_| true),
        ("/root/", "/root/", |_| true),
        ("/home/", "/home/<user>", |c| c.is_ascii_lowercase()),
        ("/tmp/", "/tmp/<name>", |c| c.is_ascii_alphabetic()),
    ];
    for (pattern, what, next_ok) in PATTERNS {
        let mut rest = line;
        while let Some(i) = rest.find(pattern) {
            rest = &rest[i + pattern.len()..];
            if rest.chars().next().is_some_and(next_ok) {
                return Some(what);
            }
        }
    }
    None
}

/// `METRALE_*` names in a text.
fn metrale_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("METRALE_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        // a name ending in `_` is a prefix being assembled (`METRALE_W_{{quant.weights}}`), not a variable
        let name = &tail[..end];
        if name.len() > "METRALE_".len() && !name.ends_with('_') {
            out.insert(name.to_string());
        }
        rest = &tail[end.max(1)..];
    }
    out
}

/// The names in the first column of ARCHITECTURE.md's "## Configuration" table.
fn configuration_table(architecture: &str) -> BTreeSet<String> {
    let Some(i) = architecture.find("## Configuration") else {
        return BTreeSet::new();
    };
    let section = &architecture[i..];
    let section = section[2..]
        .find("\n## ")
        .map_or(section, |j| &section[..j + 2]);
    section
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .filter(|n| n.starts_with("METRALE_"))
        .map(str::to_string)
        .collect()
}

/// Every problem of the tree at `repo`, one line each.
pub fn check(repo: &Path) -> Result<Vec<String>> {
    let mut problems = Vec::new();
    let files = files(repo)?;
    let arch = std::fs::read_to_string(repo.join("ARCHITECTURE.md")).unwrap_or_default();
    let table = configuration_table(&arch);
    if table.is_empty() {
        problems.push(
            "ARCHITECTURE.md: no `## Configuration` table listing the METRALE_* variables".into(),
        );
    }
    let code = |f: &str| {
        f.ends_with(".rs") || f.ends_with(".sh") || f.ends_with(".py") || f.starts_with(".ci/")
    };
    for f in &files {
        let Ok(text) = std::fs::read_to_string(repo.join(f)) else {
            continue; // binary files hold no path we wrote
        };
        // the rules' own file names what they look for
        let rules = f == "xtask/src/tidy.rs";
        if f.ends_with(".rs") {
            let first = text.lines().map(str::trim).find(|l| !l.is_empty());
            if !first.is_some_and(|l| l.starts_with("//!")) {
                problems.push(format!(
                    "{f}: does not open with a `//!` paragraph saying what it owns"
                ));
            }
        }
        for (n, line) in text.lines().enumerate().filter(|_| !rules) {
            if let Some(what) = machine_path(line) {
                problems.push(format!(
                    "{f}:{}: names a machine path ({what}); take it from an argument or a METRALE_* variable",
                    n + 1
                ));
            }
        }
        if code(f) && !rules {
            for name in metrale_names(&text) {
                if !table.contains(&name) {
                    problems.push(format!(
                        "{f}: uses {name}, which ARCHITECTURE.md's Configuration table does not list (add a row: who reads it, what it changes)"
                    ));
                }
            }
        }
    }
    for e in metrale_abi::ENTRIES {
        let t = format!("kernels/cuda/{}.cu.hbs", e.template);
        let text = std::fs::read_to_string(repo.join(&t)).unwrap_or_default();
        let want = format!("{{{{{{abi.params.{}}}}}}}", e.entry);
        if !text.contains(&want) {
            problems.push(format!(
                "{t}: entry `{}` does not render its signature from the ABI ({want})",
                e.entry
            ));
        }
    }
    Ok(problems)
}

pub fn run(args: Args) -> Result<()> {
    let repo = crate::build_target::repo_or_root(&args.repo)?;
    let problems = check(&repo)?;
    if problems.is_empty() {
        eprintln!("tidy: {} clean", repo.display());
        return Ok(());
    }
    for p in &problems {
        eprintln!("{p}");
    }
    eprintln!("tidy: {} problem(s)", problems.len());
    Err(crate::xtask_exit::Exit(1).into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn machine_paths_are_found_and_plain_ones_are_not() {
        assert_eq!(machine_path("m=/home/alice/x"), Some("/home/<user>"));
        assert_eq!(machine_path("cd /tmp/Build"), Some("/tmp/<name>"));
        assert_eq!(machine_path("/work/cache/m.gguf"), Some("/work/"));
        assert_eq!(machine_path("~/m/model.gguf and /usr/local/cuda"), None);
        assert_eq!(machine_path("mktemp in /tmp/, then ./x"), None);
    }

    #[test]
    fn names_and_the_table_are_read() {
        assert_eq!(
            metrale_names("std::env::var(\"METRALE_MODEL\") and $METRALE_CUDA_TUNING, METRALE_W_"),
            ["METRALE_CUDA_TUNING", "METRALE_MODEL"]
                .map(String::from)
                .into()
        );
        let arch = "# x\n## Configuration\n| variable | read by |\n| --- | --- |\n| `METRALE_MODEL` | tests |\n\n## Testing\n| `METRALE_TESTING` | x |\n";
        assert_eq!(
            configuration_table(arch),
            ["METRALE_MODEL".to_string()].into()
        );
    }
}
