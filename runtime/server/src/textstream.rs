//! Incremental detokenization for one generated sequence: raw token bytes in, text that is safe to
//! send out. Two things are held back between tokens:
//! - the bytes of an incomplete UTF-8 character (a byte-level BPE token may end mid-character), and
//! - text that could be the beginning of a stop string.
//!
//! Stop strings are matched as a stream: one Knuth-Morris-Pratt matcher per stop string is fed each
//! new byte once, so a token costs O(its bytes x stop strings), whatever was generated before, and
//! the text held back is at most the longest stop string. The sequence stops at the first byte that
//! completes a stop string (of several completed by the same byte, the longest counts), so where the
//! text is cut does not depend on how it was split into tokens.
//!
//! Invariants: the concatenation of everything released equals the full decoded text cut just before
//! the first completed stop string (that stop string and anything after it are never released);
//! released text is always valid UTF-8 made of complete characters; invalid byte sequences become
//! U+FFFD exactly as `String::from_utf8_lossy` would render them.

/// What one `push` released.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Released {
    /// Text that can go to the client now (may be empty).
    pub text: String,
    /// A stop string was found: `text` ends right before it and the sequence is over.
    pub stopped: bool,
}

/// One stop string's streaming matcher: `state` is the length of the longest prefix of the stop
/// string that the text seen so far ends with.
#[derive(Debug, Clone)]
struct Matcher {
    pattern: Vec<u8>,
    /// KMP failure function: `fail[i]` = length of the longest proper border of `pattern[..=i]`.
    fail: Vec<usize>,
    state: usize,
    /// Fallback steps taken (the tests check that the scan is linear).
    #[cfg(test)]
    steps: u64,
}

impl Matcher {
    fn new(pattern: &str) -> Matcher {
        let p = pattern.as_bytes().to_vec();
        let mut fail = vec![0; p.len()];
        let mut k = 0;
        for i in 1..p.len() {
            while k > 0 && p[i] != p[k] {
                k = fail[k - 1];
            }
            if p[i] == p[k] {
                k += 1;
            }
            fail[i] = k;
        }
        Matcher {
            pattern: p,
            fail,
            state: 0,
            #[cfg(test)]
            steps: 0,
        }
    }

    /// Feed one byte; true when it completes the stop string.
    fn feed(&mut self, b: u8) -> bool {
        if self.state == self.pattern.len() {
            self.state = self.fail[self.state - 1];
        }
        while self.state > 0 && self.pattern[self.state] != b {
            self.state = self.fail[self.state - 1];
            #[cfg(test)]
            {
                self.steps += 1;
            }
        }
        if self.pattern[self.state] == b {
            self.state += 1;
        }
        self.state == self.pattern.len()
    }
}

/// Streaming detokenizer with stop-string matching.
#[derive(Debug, Clone)]
pub struct TextStreamer {
    matchers: Vec<Matcher>,
    /// Trailing bytes that do not yet form a complete UTF-8 character.
    partial: Vec<u8>,
    /// Decoded text not yet released because it could start a stop string.
    pending: String,
    stopped: bool,
}

impl TextStreamer {
    /// `stops` must not contain empty strings (request validation refuses them).
    pub fn new(stops: Vec<String>) -> Self {
        debug_assert!(stops.iter().all(|s| !s.is_empty()));
        Self {
            matchers: stops.iter().map(|s| Matcher::new(s)).collect(),
            partial: Vec::new(),
            pending: String::new(),
            stopped: false,
        }
    }

    /// Whether a stop string has been found (further pushes release nothing).
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Feed the raw bytes of the next token.
    pub fn push(&mut self, bytes: &[u8]) -> Released {
        if self.stopped {
            return Released {
                text: String::new(),
                stopped: true,
            };
        }
        self.partial.extend_from_slice(bytes);
        let decoded = take_complete_utf8(&mut self.partial);
        let base = self.pending.len();
        self.pending.push_str(&decoded);
        for (i, &b) in decoded.as_bytes().iter().enumerate() {
            // every matcher sees every byte (their states must stay current); the longest
            // completed stop string starts earliest
            let mut longest = 0;
            for m in &mut self.matchers {
                if m.feed(b) {
                    longest = longest.max(m.pattern.len());
                }
            }
            if longest > 0 {
                // the stop string's first byte is held in `pending` (module docs)
                let at = base + i + 1 - longest;
                self.stopped = true;
                let text = self.pending[..at].to_owned();
                self.pending.clear();
                self.partial.clear();
                return Released {
                    text,
                    stopped: true,
                };
            }
        }
        let hold = self.matchers.iter().map(|m| m.state).max().unwrap_or(0);
        let cut = self.pending.len() - hold;
        let text = self.pending[..cut].to_owned();
        self.pending.drain(..cut);
        Released {
            text,
            stopped: false,
        }
    }

    /// The sequence ended without a stop string: release everything held back (an incomplete
    /// UTF-8 tail becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        let mut text = std::mem::take(&mut self.pending);
        if !self.partial.is_empty() {
            text.push_str(&String::from_utf8_lossy(&self.partial));
            self.partial.clear();
        }
        text
    }
}

/// Decode the longest prefix of `buf` that ends on a complete character; leave an incomplete
/// trailing character in `buf`. Invalid sequences in the middle become U+FFFD.
fn take_complete_utf8(buf: &mut Vec<u8>) -> String {
    let mut out = String::new();
    let mut start = 0;
    loop {
        match std::str::from_utf8(&buf[start..]) {
            Ok(s) => {
                out.push_str(s);
                start = buf.len();
                break;
            }
            Err(e) => {
                let valid = start + e.valid_up_to();
                out.push_str(std::str::from_utf8(&buf[start..valid]).expect("checked valid"));
                match e.error_len() {
                    // Incomplete character at the end: keep it for the next token.
                    None => {
                        start = valid;
                        break;
                    }
                    Some(n) => {
                        out.push(char::REPLACEMENT_CHARACTER);
                        start = valid + n;
                    }
                }
            }
        }
    }
    buf.drain(..start);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feed `pieces`, return (released chunks, stopped, final flush).
    fn run(stops: &[&str], pieces: &[&[u8]]) -> (Vec<String>, bool, String) {
        let mut s = TextStreamer::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = Vec::new();
        let mut stopped = false;
        for p in pieces {
            let r = s.push(p);
            out.push(r.text);
            if r.stopped {
                stopped = true;
                break;
            }
        }
        let tail = s.finish();
        (out, stopped, tail)
    }

    #[test]
    fn no_stops_passes_text_through() {
        let (out, stopped, tail) = run(&[], &[b"Hello", b" world"]);
        assert_eq!(out, vec!["Hello", " world"]);
        assert!(!stopped);
        assert_eq!(tail, "");
    }

    #[test]
    fn multibyte_char_split_across_tokens_is_held_back() {
        // "é" = C3 A9, "😀" = F0 9F 98 80
        let (out, _, tail) = run(&[], &[b"caf\xC3", b"\xA9 ", b"\xF0\x9F", b"\x98", b"\x80!"]);
        assert_eq!(out, vec!["caf", "é ", "", "", "😀!"]);
        assert_eq!(tail, "");
        for o in &out {
            assert!(!o.contains('\u{FFFD}'));
        }
    }

    #[test]
    fn incomplete_tail_at_end_becomes_replacement() {
        let (out, _, tail) = run(&[], &[b"ab\xE2\x82"]);
        assert_eq!(out, vec!["ab"]);
        assert_eq!(tail, "\u{FFFD}");
    }

    #[test]
    fn invalid_bytes_in_the_middle_become_replacement() {
        let (out, _, _) = run(&[], &[b"a\xFFb"]);
        assert_eq!(out, vec!["a\u{FFFD}b"]);
    }

    #[test]
    fn stop_string_in_one_token_is_cut() {
        let (out, stopped, tail) = run(&["\n\n"], &[b"Paris.", b"\n\nNext"]);
        assert_eq!(out.concat(), "Paris.");
        assert!(stopped);
        assert_eq!(tail, "");
    }

    #[test]
    fn stop_string_split_across_tokens_never_leaks() {
        let (out, stopped, _) = run(&["STOP"], &[b"abc S", b"T", b"O", b"P tail"]);
        assert!(stopped);
        assert_eq!(out.concat(), "abc ");
        // Nothing of "STOP" was ever released, chunk by chunk.
        assert_eq!(out, vec!["abc ", "", "", ""]);
    }

    #[test]
    fn false_stop_prefix_is_released_later() {
        let (out, stopped, tail) = run(&["STOP"], &[b"ST", b"AR", b"T"]);
        assert!(!stopped);
        assert_eq!(out, vec!["", "STAR", "T"]);
        assert_eq!(tail, "");
        let (out, stopped, tail) = run(&["STOP"], &[b"xx", b"ST"]);
        assert!(!stopped);
        assert_eq!(out, vec!["xx", ""]);
        assert_eq!(tail, "ST", "held prefix is flushed at the end");
    }

    #[test]
    fn the_first_completed_stop_wins_whatever_the_tokens() {
        let (out, stopped, _) = run(&["world", "lo w"], &[b"hello world"]);
        assert!(stopped);
        assert_eq!(out.concat(), "hel");
        // "bc" is complete before "abcd" could be, in one token or in four
        for pieces in [&[&b"abcd"[..]][..], &[b"a", b"b", b"c", b"d"]] {
            let (out, stopped, _) = run(&["abcd", "bc"], pieces);
            assert!(stopped);
            assert_eq!(out.concat(), "a");
        }
        // completed by the same byte: the longer one (it starts earlier)
        let (out, _, _) = run(&["cd", "abcd"], &[b"xabcd"]);
        assert_eq!(out.concat(), "x");
    }

    #[test]
    fn self_overlapping_stop_strings_are_found() {
        let (out, stopped, _) = run(&["aab"], &[b"aa", b"aab"]);
        assert!(stopped);
        assert_eq!(out.concat(), "aa");
        let (out, stopped, _) = run(&["abab"], &[b"abaabab"]);
        assert!(stopped);
        assert_eq!(out.concat(), "aba");
    }

    /// The streaming matcher against the plain definition (cut before the stop string whose
    /// occurrence ends first, the longest of those ending together), on random texts, stops and
    /// token splits.
    #[test]
    fn random_texts_agree_with_the_plain_definition() {
        let mut seed = 7u64;
        let mut next = |n: u64| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        for _ in 0..3000 {
            let text: Vec<u8> = (0..next(40)).map(|_| b"ab"[next(2) as usize]).collect();
            let stops: Vec<String> = (0..1 + next(3))
                .map(|_| {
                    (0..1 + next(4))
                        .map(|_| ['a', 'b'][next(2) as usize])
                        .collect()
                })
                .collect();
            let want = (1..=text.len())
                .find_map(|end| {
                    stops
                        .iter()
                        .filter(|s| text[..end].ends_with(s.as_bytes()))
                        .map(|s| end - s.len())
                        .min()
                })
                .map(|at| String::from_utf8(text[..at].to_vec()).unwrap());
            let mut pieces = Vec::new();
            let mut at = 0;
            while at < text.len() {
                let n = (1 + next(4) as usize).min(text.len() - at);
                pieces.push(&text[at..at + n]);
                at += n;
            }
            let stop_refs: Vec<&str> = stops.iter().map(String::as_str).collect();
            let (out, stopped, tail) = run(&stop_refs, &pieces);
            match want {
                Some(w) => {
                    assert!(stopped, "{stops:?} {text:?}");
                    assert_eq!(out.concat(), w, "{stops:?} {text:?}");
                }
                None => {
                    assert!(!stopped);
                    assert_eq!(out.concat() + &tail, String::from_utf8(text).unwrap());
                }
            }
        }
    }

    /// A token's cost does not grow with what came before: a million bytes through stop strings
    /// that nearly match everywhere take at most a few matcher steps per byte (the earlier scan
    /// compared every held-back suffix with every prefix: ~200 x 200 per token here).
    #[test]
    fn the_scan_is_linear() {
        let mut s = TextStreamer::new(vec![
            "a".repeat(200) + "b",
            "ab".repeat(100) + "c",
            "aab".repeat(60),
        ]);
        let mut released = 0;
        for _ in 0..100_000 {
            released += s.push(b"aaaaaaaaaa").text.len();
        }
        assert_eq!(released + 200, 1_000_000);
        for m in &s.matchers {
            assert!(
                m.steps <= 2 * 1_000_000,
                "{} fallback steps for 1 MB",
                m.steps
            );
        }
    }

    #[test]
    fn stop_string_with_multibyte_chars() {
        let (out, stopped, _) = run(&["é!"], &[b"caf\xC3", b"\xA9", b"!x"]);
        assert!(stopped);
        assert_eq!(out.concat(), "caf");
    }

    #[test]
    fn pushes_after_stop_release_nothing() {
        let mut s = TextStreamer::new(vec!["x".into()]);
        assert!(s.push(b"ax").stopped);
        assert!(s.is_stopped());
        assert_eq!(
            s.push(b"more"),
            Released {
                text: String::new(),
                stopped: true
            }
        );
        assert_eq!(s.finish(), "");
    }

    /// Property: for every split of a text into tokens, the released text equals the text cut
    /// before the first stop string.
    #[test]
    fn every_split_agrees_with_whole_text() {
        let text = "Ünïcode → stop here <END> and more".as_bytes();
        let expect = "Ünïcode → stop here ";
        for a in 0..text.len() {
            for b in a..text.len() {
                let pieces: [&[u8]; 3] = [&text[..a], &text[a..b], &text[b..]];
                let (out, stopped, tail) = run(&["<END>", "zzz"], &pieces);
                assert!(stopped, "split {a},{b}");
                assert_eq!(out.concat() + &tail, expect, "split {a},{b}");
            }
        }
    }
}
