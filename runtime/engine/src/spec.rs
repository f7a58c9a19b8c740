//! Speculative decoding: what proposes the tokens a decoding sequence verifies in one step.
//!
//! A decode step reads every weight once for one token per sequence. A verification step
//! (`SeqStep::drafted`) feeds the last accepted token and `k` proposed ones, samples at each of the
//! `k + 1` positions and keeps the proposals while the samples agree with them
//! (`metrale_backend::sampler::verify`): up to `k + 1` tokens for about the weight reads of one,
//! and the same output as plain decoding (greedy: token for token; sampled: the same distribution).
//!
//! Proposers:
//! - **prompt lookup** ([`Proposer::Ngram`], vLLM's `ngram` method with `prompt_lookup_min/max`):
//!   the sequence's last `n` tokens (the longest `n` in `min..=max` that occurs earlier) are looked
//!   up in everything before them, prompt and output; the tokens that followed their latest earlier
//!   occurrence are proposed. Free to compute and right where the output copies its input (editing,
//!   quoting, code, extraction).
//! - **a draft model** ([`Proposer::Draft`], llama.cpp's `--model-draft`, vLLM's draft method): a
//!   smaller model of the same tokenizer, on its own KV cache, proposes greedily, `k` steps of its
//!   own per verification step. Its cache follows each sequence: after a verification it is valid
//!   up to the last proposal it was fed that was accepted, and the next round feeds the rest.
//!
//! Invariants: a proposal never asks for positions past the slot or tokens past `max_tokens`; a
//! sequence under a grammar is never speculated on (a mask decides one token at a time).

/// Speculative decoding settings of an engine (`EngineConfig::speculation`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Speculation {
    /// Most tokens proposed for one sequence in one step (`--num-speculative-tokens`).
    pub tokens: usize,
    pub proposer: Proposer,
}

/// Where proposals come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Proposer {
    /// Prompt lookup over the sequence's own tokens, suffixes of `min..=max` tokens.
    Ngram { min: usize, max: usize },
    /// The engine's draft model (`Engine::spawn_with_draft`), greedy.
    Draft,
}

impl Speculation {
    /// The settings in words, for the start-up line.
    pub fn describe(&self) -> String {
        match self.proposer {
            Proposer::Ngram { min, max } => format!(
                "prompt lookup (n-grams of {min}-{max} tokens), up to {} proposed tokens a step",
                self.tokens
            ),
            Proposer::Draft => format!(
                "a draft model, greedy, up to {} proposed tokens a step",
                self.tokens
            ),
        }
    }
}

/// Prompt lookup: find the longest suffix of `history` of `min..=max` tokens (at least 1) that
/// also occurs earlier, at its latest earlier occurrence (ties in length go to the later one), and
/// return up to `k` tokens that followed it. Empty when nothing matches.
///
/// One backward scan over the positions holding the last token, each extended backwards up to
/// `max`: O(history x max) at worst, O(history) in practice.
pub fn ngram(history: &[u32], min: usize, max: usize, k: usize) -> &[u32] {
    let n = history.len();
    let min = min.max(1);
    if k == 0 || n < 2 || max < min {
        return &[];
    }
    let last = history[n - 1];
    // (match length, end of the earlier occurrence) of the best match so far
    let mut best: Option<(usize, usize)> = None;
    for end in (0..n - 1).rev() {
        if history[end] != last {
            continue;
        }
        // extend backwards: history[end - m + 1..=end] == history[n - m..n]
        let mut m = 1;
        while m < max && m <= end && history[end - m] == history[n - 1 - m] {
            m += 1;
        }
        if m >= min && best.is_none_or(|(bm, _)| m > bm) {
            best = Some((m, end));
            if m == max {
                break;
            }
        }
    }
    match best {
        Some((_, end)) => &history[end + 1..(end + 1 + k).min(n)],
        None => &[],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plain definition: for n from max down to min, the latest earlier occurrence of the
    /// last n tokens.
    fn plain(h: &[u32], min: usize, max: usize, k: usize) -> Vec<u32> {
        let len = h.len();
        for n in (min.max(1)..=max).rev() {
            if n >= len {
                continue;
            }
            let suffix = &h[len - n..];
            for start in (0..len - n).rev() {
                if &h[start..start + n] == suffix {
                    return h[start + n..(start + n + k).min(len)].to_vec();
                }
            }
        }
        Vec::new()
    }

    #[test]
    fn lookup_finds_the_longest_latest_match() {
        // "a b c d | x b c e | b c" : the suffix "b c" occurs twice; the latest is followed by e
        let h = [1, 2, 3, 4, 9, 2, 3, 5, 2, 3];
        assert_eq!(ngram(&h, 1, 3, 2), &[5, 2]);
        // with a longer suffix only the first occurrence matches "a b c"
        let h = [1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3];
        assert_eq!(ngram(&h, 1, 3, 3), &[4, 9, 2]);
        assert_eq!(ngram(&h, 3, 3, 8), &[4, 9, 2, 3, 5, 1, 2, 3]);
        // min above every match: nothing
        assert_eq!(ngram(&h, 4, 5, 3), &[] as &[u32]);
        // the proposal stops at the history's end
        let h = [7, 8, 7];
        assert_eq!(ngram(&h, 1, 2, 5), &[8, 7]);
        assert_eq!(ngram(&[7], 1, 2, 5), &[] as &[u32]);
        assert_eq!(ngram(&h, 1, 2, 0), &[] as &[u32]);
    }

    #[test]
    fn lookup_matches_the_plain_definition() {
        // pseudo-random histories over small alphabets (many repeats)
        let mut x = 12345u64;
        for case in 0..2000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let len = 1 + (x >> 33) as usize % 60;
            let alpha = 2 + case % 5;
            let h: Vec<u32> = (0..len)
                .map(|i| {
                    let z = x.wrapping_add(i as u64 * 0x9E37_79B9_7F4A_7C15);
                    ((z ^ (z >> 29)) % alpha as u64) as u32
                })
                .collect();
            for (min, max, k) in [(1, 1, 3), (1, 4, 5), (2, 3, 2), (3, 5, 4)] {
                assert_eq!(
                    ngram(&h, min, max, k),
                    plain(&h, min, max, k).as_slice(),
                    "{h:?} min {min} max {max} k {k}"
                );
            }
        }
    }
}
