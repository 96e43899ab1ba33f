//! A pull scanner for JSON over any `Read`, built for multi-GB Chrome traces: it never holds more
//! than one buffer of input, copies only the strings the caller asks for, and skips everything else
//! with `memchr`. It checks structure (brackets, commas, colons, literals) and reports the byte
//! offset of the first problem; it does not validate UTF-8 (real traces contain invalid bytes in
//! kernel and file names) and leaves number syntax to the caller's number parsers.

use std::io::Read;

use super::error::ScanError;

const BUF_BYTES: usize = 1 << 18;
/// Deeper nesting than this in a skipped value is treated as hostile input.
const MAX_DEPTH: usize = 4096;

pub(crate) type Result<T> = std::result::Result<T, ScanError>;

pub(crate) struct Scanner<R> {
    src: R,
    buf: Box<[u8]>,
    pos: usize,
    len: usize,
    /// Bytes of input before `buf[0]`.
    consumed: u64,
    eof: bool,
}

impl<R: Read> Scanner<R> {
    pub(crate) fn new(src: R) -> Self {
        Scanner { src, buf: vec![0u8; BUF_BYTES].into_boxed_slice(), pos: 0, len: 0, consumed: 0, eof: false }
    }

    /// Byte offset of the next unread byte.
    pub(crate) fn offset(&self) -> u64 {
        self.consumed + self.pos as u64
    }

    /// Refills the buffer; returns false at end of input.
    #[cold]
    fn fill(&mut self) -> Result<bool> {
        debug_assert!(self.pos >= self.len);
        if self.eof {
            return Ok(false);
        }
        self.consumed += self.len as u64;
        self.pos = 0;
        self.len = 0;
        loop {
            match self.src.read(&mut self.buf) {
                Ok(0) => {
                    self.eof = true;
                    return Ok(false);
                }
                Ok(n) => {
                    self.len = n;
                    return Ok(true);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(ScanError::Io(e)),
            }
        }
    }

    #[inline]
    fn peek(&mut self) -> Result<Option<u8>> {
        if self.pos < self.len || self.fill()? {
            Ok(Some(self.buf[self.pos]))
        } else {
            Ok(None)
        }
    }

    pub(crate) fn syntax(&self, what: impl Into<String>) -> ScanError {
        ScanError::Syntax { offset: self.offset(), what: what.into() }
    }

    pub(crate) fn truncated(&self, inside: &'static str) -> ScanError {
        ScanError::Truncated { offset: self.offset(), inside }
    }

    /// Skips whitespace (and a UTF-8 byte-order mark) and returns the next byte without consuming it.
    #[inline]
    pub(crate) fn peek_token(&mut self, inside: &'static str) -> Result<u8> {
        loop {
            match self.peek()? {
                Some(b' ' | b'\n' | b'\r' | b'\t') => self.pos += 1,
                Some(b) => return Ok(b),
                None => return Err(self.truncated(inside)),
            }
        }
    }

    /// Like `peek_token` but end of input is `None`.
    pub(crate) fn peek_token_or_eof(&mut self) -> Result<Option<u8>> {
        loop {
            match self.peek()? {
                Some(b' ' | b'\n' | b'\r' | b'\t') => self.pos += 1,
                Some(0xEF) if self.offset() == 0 => {
                    // A UTF-8 byte-order mark, written by some Windows tools.
                    for expected in [0xEF, 0xBB, 0xBF] {
                        if self.peek()? != Some(expected) {
                            return Err(self.syntax("invalid byte at start of file"));
                        }
                        self.pos += 1;
                    }
                }
                other => return Ok(other),
            }
        }
    }

    #[inline]
    pub(crate) fn bump(&mut self) {
        debug_assert!(self.pos < self.len);
        self.pos += 1;
    }

    pub(crate) fn expect(&mut self, byte: u8, inside: &'static str) -> Result<()> {
        let got = self.peek_token(inside)?;
        if got != byte {
            return Err(self.syntax(format!("expected '{}', found {}", byte as char, describe(got))));
        }
        self.pos += 1;
        Ok(())
    }

    /// After a value inside an object or array: consumes ',' and returns true, or consumes `close`
    /// and returns false.
    #[inline]
    pub(crate) fn comma_or_close(&mut self, close: u8, inside: &'static str) -> Result<bool> {
        match self.peek_token(inside)? {
            b',' => {
                self.pos += 1;
                Ok(true)
            }
            b if b == close => {
                self.pos += 1;
                Ok(false)
            }
            b => Err(self.syntax(format!("expected ',' or '{}' in {inside}, found {}", close as char, describe(b)))),
        }
    }

    /// Reads an object key and its ':' into `key`. Call after '{' or ','.
    #[inline]
    pub(crate) fn key(&mut self, key: &mut Vec<u8>, inside: &'static str) -> Result<()> {
        let b = self.peek_token(inside)?;
        if b != b'"' {
            return Err(self.syntax(format!("expected a key string in {inside}, found {}", describe(b))));
        }
        self.pos += 1;
        key.clear();
        self.string_body(key)?;
        self.expect(b':', inside)
    }

    /// Reads a string value (opening quote next) into `out`, decoding escapes.
    pub(crate) fn string(&mut self, out: &mut Vec<u8>, inside: &'static str) -> Result<()> {
        let b = self.peek_token(inside)?;
        if b != b'"' {
            return Err(self.syntax(format!("expected a string in {inside}, found {}", describe(b))));
        }
        self.pos += 1;
        out.clear();
        self.string_body(out)
    }

    /// The rest of a string after its opening quote.
    fn string_body(&mut self, out: &mut Vec<u8>) -> Result<()> {
        loop {
            if self.pos >= self.len && !self.fill()? {
                return Err(self.truncated("a string"));
            }
            let window = &self.buf[self.pos..self.len];
            match memchr::memchr2(b'"', b'\\', window) {
                Some(i) => {
                    out.extend_from_slice(&window[..i]);
                    let special = window[i];
                    self.pos += i + 1;
                    if special == b'"' {
                        return Ok(());
                    }
                    self.escape(out)?;
                }
                None => {
                    out.extend_from_slice(window);
                    self.pos = self.len;
                }
            }
        }
    }

    fn next_byte(&mut self, inside: &'static str) -> Result<u8> {
        match self.peek()? {
            Some(b) => {
                self.pos += 1;
                Ok(b)
            }
            None => Err(self.truncated(inside)),
        }
    }

    fn escape(&mut self, out: &mut Vec<u8>) -> Result<()> {
        let c = self.next_byte("a string escape")?;
        let simple = match c {
            b'"' => b'"',
            b'\\' => b'\\',
            b'/' => b'/',
            b'b' => 8,
            b'f' => 12,
            b'n' => b'\n',
            b'r' => b'\r',
            b't' => b'\t',
            b'u' => {
                let mut code = self.hex4()?;
                if (0xD800..0xDC00).contains(&code) {
                    // A high surrogate: take the low one if it follows, else replace.
                    if self.peek()? == Some(b'\\') {
                        self.pos += 1;
                        if self.next_byte("a string escape")? != b'u' {
                            return Err(self.syntax("invalid escape after a high surrogate"));
                        }
                        let low = self.hex4()?;
                        code = if (0xDC00..0xE000).contains(&low) {
                            0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)
                        } else {
                            0xFFFD
                        };
                    } else {
                        code = 0xFFFD;
                    }
                }
                let ch = char::from_u32(code).unwrap_or('\u{FFFD}');
                let mut tmp = [0u8; 4];
                out.extend_from_slice(ch.encode_utf8(&mut tmp).as_bytes());
                return Ok(());
            }
            other => return Err(self.syntax(format!("invalid string escape '\\{}'", other.escape_ascii()))),
        };
        out.push(simple);
        Ok(())
    }

    fn hex4(&mut self) -> Result<u32> {
        let mut code = 0u32;
        for _ in 0..4 {
            let b = self.next_byte("a \\u escape")?;
            let digit = (b as char).to_digit(16).ok_or_else(|| self.syntax("invalid \\u escape"))?;
            code = code * 16 + digit;
        }
        Ok(code)
    }

    /// Skips a string after its opening quote without copying it.
    fn skip_string_body(&mut self) -> Result<()> {
        loop {
            if self.pos >= self.len && !self.fill()? {
                return Err(self.truncated("a string"));
            }
            let window = &self.buf[self.pos..self.len];
            match memchr::memchr2(b'"', b'\\', window) {
                Some(i) => {
                    self.pos += i + 1;
                    if window[i] == b'"' {
                        return Ok(());
                    }
                    // Any escaped byte; \u digits are plain bytes for skipping.
                    self.next_byte("a string escape")?;
                }
                None => self.pos = self.len,
            }
        }
    }

    /// Reads the raw text of a number (or a bare literal) into `out`.
    pub(crate) fn number(&mut self, out: &mut Vec<u8>, inside: &'static str) -> Result<()> {
        let first = self.peek_token(inside)?;
        if !(first == b'-' || first.is_ascii_digit()) {
            return Err(self.syntax(format!("expected a number in {inside}, found {}", describe(first))));
        }
        out.clear();
        loop {
            if self.pos >= self.len && !self.fill()? {
                return Ok(());
            }
            let window = &self.buf[self.pos..self.len];
            let n = window.iter().position(|&b| !is_number_byte(b)).unwrap_or(window.len());
            out.extend_from_slice(&window[..n]);
            self.pos += n;
            if out.len() > 400 {
                return Err(self.syntax("number longer than 400 characters"));
            }
            if self.pos < self.len {
                return Ok(());
            }
        }
    }

    /// Reads a scalar as raw text: a string's contents or a number's text; returns whether it
    /// was a string. Objects, arrays and literals are skipped and give `None`.
    pub(crate) fn scalar(&mut self, out: &mut Vec<u8>, inside: &'static str) -> Result<Option<bool>> {
        match self.peek_token(inside)? {
            b'"' => {
                self.string(out, inside)?;
                Ok(Some(true))
            }
            b'-' | b'0'..=b'9' => {
                self.number(out, inside)?;
                Ok(Some(false))
            }
            _ => {
                self.skip_value(inside)?;
                Ok(None)
            }
        }
    }

    /// Skips one complete value of any kind, checking bracket structure, without recursion.
    pub(crate) fn skip_value(&mut self, inside: &'static str) -> Result<()> {
        let mut stack: Vec<u8> = Vec::new();
        // Invariant: `stack` holds the closing bracket of every open container, innermost last;
        // `want_value` is true where a value must come next.
        let mut want_value = true;
        loop {
            let b = self.peek_token(if stack.is_empty() { inside } else { "a nested value" })?;
            if want_value {
                match b {
                    b'{' | b'[' => {
                        self.pos += 1;
                        if stack.len() >= MAX_DEPTH {
                            return Err(self.syntax(format!("nesting deeper than {MAX_DEPTH} levels")));
                        }
                        let close = if b == b'{' { b'}' } else { b']' };
                        stack.push(close);
                        let next = self.peek_token("a nested value")?;
                        if next == close {
                            self.pos += 1;
                            stack.pop();
                            want_value = false;
                        } else if close == b'}' {
                            self.expect_key_skip()?;
                        }
                        // else: an array's first value follows; want_value stays true.
                        if stack.is_empty() {
                            return Ok(());
                        }
                        continue;
                    }
                    b'"' => {
                        self.pos += 1;
                        self.skip_string_body()?;
                    }
                    b'-' | b'0'..=b'9' => loop {
                        if self.pos >= self.len && !self.fill()? {
                            break;
                        }
                        let window = &self.buf[self.pos..self.len];
                        let n = window.iter().position(|&b| !is_number_byte(b)).unwrap_or(window.len());
                        self.pos += n;
                        if self.pos < self.len {
                            break;
                        }
                    },
                    b't' => self.literal(b"true")?,
                    b'f' => self.literal(b"false")?,
                    b'n' => self.literal(b"null")?,
                    other => return Err(self.syntax(format!("expected a value, found {}", describe(other)))),
                }
                want_value = false;
                if stack.is_empty() {
                    return Ok(());
                }
            } else {
                let close = *stack.last().expect("non-empty: checked after every value");
                self.pos += 1;
                if b == b',' {
                    if close == b'}' {
                        self.expect_key_skip()?;
                    }
                    want_value = true;
                } else if b == close {
                    stack.pop();
                    if stack.is_empty() {
                        return Ok(());
                    }
                } else {
                    self.pos -= 1;
                    return Err(self.syntax(format!("expected ',' or '{}', found {}", close as char, describe(b))));
                }
            }
        }
    }

    fn expect_key_skip(&mut self) -> Result<()> {
        let b = self.peek_token("an object")?;
        if b != b'"' {
            return Err(self.syntax(format!("expected a key string, found {}", describe(b))));
        }
        self.pos += 1;
        self.skip_string_body()?;
        self.expect(b':', "an object")
    }

    fn literal(&mut self, word: &'static [u8]) -> Result<()> {
        for &expected in word {
            match self.peek()? {
                Some(b) if b == expected => self.pos += 1,
                Some(b) => return Err(self.syntax(format!("invalid literal: found {}", describe(b)))),
                None => return Err(self.truncated("a literal")),
            }
        }
        Ok(())
    }
}

#[inline]
fn is_number_byte(b: u8) -> bool {
    b.is_ascii_digit() || matches!(b, b'-' | b'+' | b'.' | b'e' | b'E')
}

/// A byte for an error message: printable ASCII as itself, anything else in hex.
pub(crate) fn describe(b: u8) -> String {
    if b.is_ascii_graphic() {
        format!("'{}'", b as char)
    } else {
        format!("byte 0x{b:02x}")
    }
}

/// Parses a decimal number of microseconds (`123`, `4203669604595.407`, `1.5e3`, `-2`) to
/// integer nanoseconds exactly; digits beyond nanoseconds round half away from zero. `None` when
/// the text is not a number or the value does not fit in an `i64`.
pub(crate) fn micros_to_nanos(text: &[u8]) -> Option<i64> {
    // Fast path: `digits[.ddd]` short enough for i64 arithmetic, the common case.
    if !text.is_empty() && text.len() <= 24 {
        let (int_part, frac) = match memchr::memchr(b'.', text) {
            Some(i) => (&text[..i], &text[i + 1..]),
            None => (text, &text[..0]),
        };
        if !int_part.is_empty() && frac.len() <= 3 && int_part.iter().chain(frac).all(u8::is_ascii_digit) {
            let mut v: i64 = 0;
            let mut f: i64 = 0;
            for &b in frac {
                f = f * 10 + i64::from(b - b'0');
            }
            for _ in frac.len()..3 {
                f *= 10;
            }
            // Up to 15 integer digits cannot overflow; longer ones take the checked slow path.
            if int_part.len() <= 15 {
                for &b in int_part {
                    v = v * 10 + i64::from(b - b'0');
                }
                return Some(v * 1000 + f);
            }
        }
    }
    let (negative, rest) = match text.first()? {
        b'-' => (true, &text[1..]),
        _ => (false, text),
    };
    let mut mantissa: i128 = 0;
    let mut n_digits = 0usize;
    let mut frac_digits: i64 = 0;
    let mut seen_dot = false;
    let mut i = 0;
    while i < rest.len() {
        let b = rest[i];
        match b {
            b'0'..=b'9' => {
                // Digits past 36 cannot change an i64 nanosecond value except by overflowing, so
                // later integer digits scale and later fraction digits are dropped.
                if n_digits < 36 {
                    mantissa = mantissa * 10 + i128::from(b - b'0');
                    if mantissa != 0 {
                        n_digits += 1;
                    }
                    if seen_dot {
                        frac_digits += 1;
                    }
                } else if !seen_dot {
                    frac_digits -= 1;
                }
            }
            b'.' if !seen_dot => seen_dot = true,
            b'e' | b'E' => break,
            _ => return None,
        }
        i += 1;
    }
    let digits_total = rest[..i].iter().filter(|b| b.is_ascii_digit()).count();
    if digits_total == 0 {
        return None;
    }
    let mut exponent: i64 = 0;
    if i < rest.len() {
        let exp_text = std::str::from_utf8(&rest[i + 1..]).ok()?;
        exponent = exp_text.strip_prefix('+').unwrap_or(exp_text).parse::<i64>().ok()?;
        if exponent.abs() > 400 {
            return if mantissa == 0 || exponent < 0 { Some(0) } else { None };
        }
    }
    // value_ns = mantissa * 10^(exponent - frac_digits + 3)
    let scale = exponent - frac_digits + 3;
    let magnitude: i128 = if scale >= 0 {
        let mut m = mantissa;
        for _ in 0..scale {
            m = m.checked_mul(10)?;
            if m > i128::from(i64::MAX) + 1 {
                return None;
            }
        }
        m
    } else if scale < -38 {
        0
    } else {
        let divisor = 10i128.pow((-scale) as u32);
        let q = mantissa / divisor;
        let r = mantissa % divisor;
        if r * 2 >= divisor {
            q + 1
        } else {
            q
        }
    };
    let signed = if negative { -magnitude } else { magnitude };
    i64::try_from(signed).ok()
}

/// Parses a JSON number that names something (an id, a byte count) to `u64`. Values beyond `u64`
/// are folded into 64 bits so that equal ids stay equal; fractions are truncated; negative
/// values and non-numbers give `None`.
pub(crate) fn parse_id(text: &[u8]) -> Option<u64> {
    if text.is_empty() || text[0] == b'-' {
        return None;
    }
    let mut value: u128 = 0;
    let mut overflow_fold: u64 = 0;
    for &b in text {
        match b {
            b'0'..=b'9' => {
                value = value * 10 + u128::from(b - b'0');
                if value > u128::from(u64::MAX) * 1000 {
                    // Fold the high part away; the result is a hash, not the number.
                    overflow_fold = overflow_fold.rotate_left(7) ^ (value as u64);
                    value %= 1_000_000_007;
                }
            }
            b'.' | b'e' | b'E' => break,
            _ => return None,
        }
    }
    let low = if value > u128::from(u64::MAX) { (value as u64) ^ ((value >> 64) as u64) } else { value as u64 };
    Some(low ^ overflow_fold)
}

/// Parses a JSON number to `i64`, truncating fractions; `None` when it is not a number or too large.
pub(crate) fn parse_i64(text: &[u8]) -> Option<i64> {
    let s = std::str::from_utf8(text).ok()?;
    if let Ok(v) = s.parse::<i64>() {
        return Some(v);
    }
    let v = s.parse::<f64>().ok()?;
    if v.is_finite() && v.abs() < 9.2e18 {
        Some(v as i64)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_ns(input: &str, expected: Option<i64>) {
        assert_eq!(micros_to_nanos(input.as_bytes()), expected, "input {input:?}");
    }

    #[test]
    fn microseconds_to_nanoseconds() {
        check_ns("0", Some(0));
        check_ns("1", Some(1000));
        check_ns("-2", Some(-2000));
        check_ns("68.0", Some(68_000));
        check_ns("4203669604595.407", Some(4_203_669_604_595_407));
        check_ns("1712195495519695.8", Some(1_712_195_495_519_695_800));
        check_ns("0.0004", Some(0));
        check_ns("0.0005", Some(1));
        check_ns("1.5e3", Some(1_500_000));
        check_ns("1.5E-3", Some(2));
        check_ns("9223372036854775.807", Some(i64::MAX));
        check_ns("9223372036854775.808", None);
        check_ns("99999999999999999999999999", None);
        check_ns("", None);
        check_ns("-", None);
        check_ns("1.2.3", None);
        check_ns("1e", None);
        check_ns("0.000000000000000000000000000000000000000001", Some(0));
    }

    fn check_id(input: &str, expected: Option<u64>) {
        assert_eq!(parse_id(input.as_bytes()), expected, "input {input:?}");
    }

    #[test]
    fn ids() {
        check_id("0", Some(0));
        check_id("18446744073709551615", Some(u64::MAX));
        check_id("12.0", Some(12));
        check_id("-1", None);
        check_id("abc", None);
        // Beyond u64: some stable value, distinct from its neighbour.
        let a = parse_id(b"18446744073709551616").unwrap();
        let b = parse_id(b"18446744073709551617").unwrap();
        assert_ne!(a, b);
        assert_eq!(parse_id(b"123456789012345678901234567890"), parse_id(b"123456789012345678901234567890"));
    }

    fn check_skip(input: &str, expected_rest: std::result::Result<&str, &str>) {
        let mut sc = Scanner::new(input.as_bytes());
        match (sc.skip_value("test"), expected_rest) {
            (Ok(()), Ok(rest)) => assert_eq!(&input[sc.offset() as usize..], rest, "input {input:?}"),
            (Err(e), Err(what)) => assert!(format!("{e:?}").contains(what), "input {input:?}: {e:?}"),
            (got, want) => panic!("input {input:?}: got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn skipping_values() {
        check_skip(r#"{"a": [1, 2, {"b": "x\"y"}], "c": null} tail"#, Ok(" tail"));
        check_skip("[] ,", Ok(" ,"));
        check_skip("{} ,", Ok(" ,"));
        check_skip("-1.5e3,", Ok(","));
        check_skip("true]", Ok("]"));
        check_skip(r#""\\" x"#, Ok(" x"));
        check_skip("[1, 2", Err("Truncated"));
        check_skip("[1 2]", Err("expected ','"));
        check_skip("{\"a\" 1}", Err("expected ':'"));
        check_skip("{1: 2}", Err("expected a key"));
        check_skip("[1}", Err("expected ','"));
        check_skip("tru", Err("Truncated"));
        check_skip("nul!", Err("invalid literal"));
        check_skip(&"[".repeat(5000), Err("nesting deeper"));
    }

    #[test]
    fn strings_decode_escapes_and_keep_invalid_bytes() {
        let input = b"\"a\\n\\u00e9\\ud83d\\ude00\\ud800x\xff\"";
        let mut sc = Scanner::new(&input[..]);
        let mut out = Vec::new();
        sc.string(&mut out, "test").unwrap();
        assert_eq!(out, "a\n\u{e9}\u{1F600}\u{FFFD}x".bytes().chain([0xff]).collect::<Vec<u8>>());
    }
}
