//! The command-line options the CUDA bench examples share: `--name value` pairs and
//! comma-separated lists of counts.

/// The value after `--name` in `args`, else `dflt`.
pub fn opt(args: &[String], name: &str, dflt: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| dflt.to_string())
}

/// The comma-separated counts after `--name` (else `dflt`; empty: none). An entry that is not a
/// count exits with a message naming the option.
pub fn counts(args: &[String], name: &str, dflt: &str) -> Vec<usize> {
    opt(args, name, dflt)
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.trim().parse().unwrap_or_else(|_| {
                eprintln!(
                    "{name}: `{s}` is not a count; give comma-separated counts, e.g. {name} 16,64"
                );
                std::process::exit(2)
            })
        })
        .collect()
}
