//! Incremental detokenization for one generated sequence: raw token bytes in, text that is safe to
//! send out. Two things are held back between tokens:
//! - the bytes of an incomplete UTF-8 character (a byte-level BPE token may end mid-character), and
//! - text that could be the beginning of a stop string.
//!
//! Invariants: the concatenation of everything released equals the full decoded text cut just before
//! the first occurrence of any stop string (that stop string and anything after it are never
//! released); released text is always valid UTF-8 made of complete characters; invalid byte
//! sequences become U+FFFD exactly as `String::from_utf8_lossy` would render them.

/// What one `push` released.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Released {
    /// Text that can go to the client now (may be empty).
    pub text: String,
    /// A stop string was found: `text` ends right before it and the sequence is over.
    pub stopped: bool,
}

/// Streaming detokenizer with stop-string matching.
#[derive(Debug, Clone)]
pub struct TextStreamer {
    stops: Vec<String>,
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
            stops,
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
        self.pending.push_str(&decoded);

        if let Some(at) = self.first_stop() {
            self.stopped = true;
            let text = self.pending[..at].to_owned();
            self.pending.clear();
            self.partial.clear();
            return Released {
                text,
                stopped: true,
            };
        }
        let hold = self.stop_prefix_len();
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

    /// Byte offset in `pending` of the earliest stop-string occurrence.
    fn first_stop(&self) -> Option<usize> {
        self.stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min()
    }

    /// Length of the longest suffix of `pending` that is a proper prefix of some stop string.
    fn stop_prefix_len(&self) -> usize {
        let mut best = 0;
        for stop in &self.stops {
            // Candidate prefix lengths, longest first, on char boundaries of the stop string.
            for (k, _) in stop.char_indices().rev() {
                if k == 0 || k <= best {
                    break;
                }
                if self.pending.ends_with(&stop[..k]) {
                    best = k;
                    break;
                }
            }
        }
        best
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
    fn earliest_of_several_stops_wins() {
        let (out, stopped, _) = run(&["world", "lo w"], &[b"hello world"]);
        assert!(stopped);
        assert_eq!(out.concat(), "hel");
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
