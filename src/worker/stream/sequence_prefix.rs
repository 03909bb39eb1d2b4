//! A message's sequence number read from the text before it alone, for the
//! shape most feeds send: each object on the pointer's path opens with a few
//! plain members (strings without escapes, numbers, `true`, `false`,
//! `null`), then the member the pointer names, and the number at the end is
//! an unsigned integer.
//!
//! With the default data format nothing after the number needs reading: the
//! sink carries the message as a string. A full parse (serde_json, which
//! must skip every string to its end) was ~80 ns of the ~550 a saturated
//! worker spent on a bench message, whose number is its first member; this
//! reads its first ten bytes. Anything outside the shape (an escape in a key,
//! an array or object before the member, a number that is not an unsigned
//! integer, text that is not JSON) answers `None`, and the caller parses
//! the text with serde_json, which gives the same answer whenever this one
//! gives one (`sequence::tests`, over generated documents and their
//! one-byte mutations).

/// The unsigned integer at the object keys `keys` (a pointer's tokens, all
/// of them object keys), read from the text before it; `None` when the text
/// is not in the shape this reads.
pub(super) fn leading_u64<'k>(text: &str, keys: impl IntoIterator<Item = &'k str>) -> Option<u64> {
    number_and_end(text, keys).map(|(seq, _)| seq)
}

/// Objects deeper than this are left to serde_json, which refuses nesting
/// beyond 127 levels.
const MAX_DEPTH: usize = 100;

/// [`leading_u64`], and where the number ends in the text.
pub(super) fn number_and_end<'k>(
    text: &str,
    keys: impl IntoIterator<Item = &'k str>,
) -> Option<(u64, usize)> {
    let mut scan = Scan {
        bytes: text.as_bytes(),
        at: 0,
    };
    for (depth, key) in keys.into_iter().enumerate() {
        if depth == MAX_DEPTH {
            return None;
        }
        scan.expect(b'{')?;
        loop {
            scan.expect(b'"')?;
            let name = scan.plain_string()?;
            scan.expect(b':')?;
            if name == key.as_bytes() {
                break;
            }
            scan.plain_scalar()?;
            scan.expect(b',')?;
        }
    }
    scan.unsigned().map(|seq| (seq, scan.at))
}

struct Scan<'t> {
    bytes: &'t [u8],
    at: usize,
}

impl<'t> Scan<'t> {
    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.at).copied()
    }

    fn whitespace(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    /// Skips JSON whitespace, then takes `byte`.
    fn expect(&mut self, byte: u8) -> Option<()> {
        self.whitespace();
        (self.peek() == Some(byte)).then(|| self.at += 1)
    }

    /// The rest of a string whose opening quote was taken, if it has no
    /// escape and no control byte (both are for serde_json to read).
    fn plain_string(&mut self) -> Option<&'t [u8]> {
        let rest = &self.bytes[self.at..];
        let len = rest
            .iter()
            .position(|&b| b == b'"' || b == b'\\' || b < 0x20)?;
        (rest[len] == b'"').then(|| {
            self.at += len + 1;
            &rest[..len]
        })
    }

    /// Skips a string without escapes, a number, `true`, `false` or `null`.
    fn plain_scalar(&mut self) -> Option<()> {
        self.whitespace();
        match self.peek()? {
            b'"' => {
                self.at += 1;
                self.plain_string().map(drop)
            }
            b'-' | b'0'..=b'9' => self.number(),
            _ => ["true", "false", "null"].into_iter().find_map(|word| {
                self.bytes[self.at..]
                    .starts_with(word.as_bytes())
                    .then(|| self.at += word.len())
            }),
        }
    }

    /// Skips a number by JSON's grammar: `-`? then `0` or a digit run not
    /// starting with `0`, then a fraction and an exponent, each optional.
    fn number(&mut self) -> Option<()> {
        if self.peek() == Some(b'-') {
            self.at += 1;
        }
        match self.peek()? {
            b'0' => self.at += 1,
            b'1'..=b'9' => self.digits(),
            _ => return None,
        }
        if self.peek() == Some(b'.') {
            self.at += 1;
            self.some_digits()?;
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.at += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.at += 1;
            }
            self.some_digits()?;
        }
        Some(())
    }

    fn digits(&mut self) {
        while self.peek().is_some_and(|b| b.is_ascii_digit()) {
            self.at += 1;
        }
    }

    fn some_digits(&mut self) -> Option<()> {
        let start = self.at;
        self.digits();
        (self.at > start).then_some(())
    }

    /// An unsigned integer as serde_json reads one: no sign, no leading
    /// zero, no fraction or exponent after it (then it is a float), within
    /// `u64`. Something must follow it (a text that ends in a digit may
    /// have been cut inside the number); what, is not read.
    fn unsigned(&mut self) -> Option<u64> {
        self.whitespace();
        let start = self.at;
        self.digits();
        let digits = &self.bytes[start..self.at];
        let leading_zero = digits.len() > 1 && digits[0] == b'0';
        if digits.is_empty()
            || leading_zero
            || matches!(self.peek(), None | Some(b'.' | b'e' | b'E'))
        {
            return None;
        }
        digits.iter().try_fold(0u64, |n, d| {
            n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
        })
    }
}
