//! A batch of JSON event records parsed straight into Arrow columns, in one pass, without the GIL.
//!
//! `Decoder(columns)` is made once per table and set of columns: each column is a name, the path of
//! keys where it is in a record (`["data", "usage", "prompt_tokens"]`), and a kind: "int", "float",
//! "bool", "str", "json" (any JSON value, kept as its text), ("list", kind) or ("struct", [(name,
//! kind), ...]); and, optionally, `objects`: the paths of sub-records (`["data", "usage"]`) that must
//! hold an object or null even where none of their columns is asked (as row by row).
//! `Decoder.decode(records)` reads a list of records as `schemas.scan.Record` holds them (topic,
//! partition, offset, timestamp, key, value: bytes, or None for an empty record) and returns
//! the columns, then each record's partition, offset and timestamp, as one Arrow struct array, which
//! polars imports through the Arrow C data interface (`pl.DataFrame(columns)`: the
//! `__arrow_c_array__` protocol). Free-form JSON ("json") comes as its text, with the rows whose text
//! orjson would write otherwise (spaces, floats, other escapes, a repeated key).
//!
//! Columnar scans skip the `Record`s: `take(messages, ends)` sorts one `Consumer.consume`'s
//! confluent-kafka messages in one pass (errors apart; those of a partition in `ends` before its end
//! kept, as a `Fetched`: their values and places), and `Decoder.decode_fetched(fetched)` reads them
//! as `decode` reads records.
//!
//! Token ids and plain floats (`-0.8444218515250481`) followed by `,` or `]` are read in one step
//! (`compact_int`, `compact_float`: Clinger's fast path, exact where it applies); anything else goes
//! the full way, which gives the same values.
//!
//! Strict, like msgspec with the models' types: a value of another type (a float or text where an
//! int is due, an int beyond 64 bits, a list of lists), a repeated key, bytes that are not UTF-8 or
//! not JSON, a record that is not an object: `decode` raises ValueError, naming the record and byte,
//! and the caller reads that batch row by row instead. Keys not asked for are checked and skipped;
//! a key that is missing or null gives a null. An int is accepted where a float is due (as Python).
//!
//! Why not serde_json: on the same 20,000 call events, in one run, serde_json 1.0.154 typed (derived
//! `Deserialize` with `Cow<str>` and `&RawValue`, token lists pushed straight into column buffers as
//! a `DeserializeSeed` would) took 1.31–1.41× this pass's CPU (7.9–9.2 µs per 2.9 kB event), 1.49×
//! with `float_roundtrip` (exact floats, as orjson reads them); docs/queries.md has the figures.
//! `tests/test_decode.py` checks this parser against orjson row by row on random records.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

use arrow_buffer::{BooleanBufferBuilder, Buffer, NullBufferBuilder};
use arrow_data::ArrayData;
use arrow_data::ffi::FFI_ArrowArray;
use arrow_schema::ffi::FFI_ArrowSchema;
use arrow_schema::{DataType, Field, Fields};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::intern;
use pyo3::types::{PyBytes, PyCapsule, PyList, PyString, PyTuple};

mod shapes;

type Res<T> = Result<T, &'static str>;

const MAX_DEPTH: usize = 512;

// --- the schema ----------------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Kind {
    Int,
    Float,
    Bool,
    Str,
    Json,
    List(Box<Kind>),
    Struct(Vec<(String, Kind)>),
}

impl Kind {
    fn from_py(obj: &Bound<'_, PyAny>) -> PyResult<Kind> {
        if let Ok(name) = obj.cast::<PyString>() {
            return match name.to_str()? {
                "int" => Ok(Kind::Int),
                "float" => Ok(Kind::Float),
                "bool" => Ok(Kind::Bool),
                "str" => Ok(Kind::Str),
                "json" => Ok(Kind::Json),
                other => Err(PyValueError::new_err(format!(
                    "unknown column kind {other:?}"
                ))),
            };
        }
        let (tag, inner): (String, Bound<'_, PyAny>) = obj.extract()?;
        match tag.as_str() {
            "list" => Ok(Kind::List(Box::new(Kind::from_py(&inner)?))),
            "struct" => {
                let members: Vec<(String, Bound<'_, PyAny>)> = inner.extract()?;
                let members = members
                    .iter()
                    .map(|(name, kind)| Ok((name.clone(), Kind::from_py(kind)?)))
                    .collect::<PyResult<Vec<_>>>()?;
                Ok(Kind::Struct(members))
            }
            other => Err(PyValueError::new_err(format!(
                "unknown column kind {other:?}"
            ))),
        }
    }

    fn data_type(&self) -> DataType {
        match self {
            Kind::Int => DataType::Int64,
            Kind::Float => DataType::Float64,
            Kind::Bool => DataType::Boolean,
            Kind::Str | Kind::Json => DataType::Utf8View,
            Kind::List(item) => {
                DataType::LargeList(Arc::new(Field::new("item", item.data_type(), true)))
            }
            Kind::Struct(members) => DataType::Struct(Fields::from(
                members
                    .iter()
                    .map(|(name, kind)| Field::new(name, kind.data_type(), true))
                    .collect::<Vec<_>>(),
            )),
        }
    }
}

/// Where the asked-for columns are in a record: at each level the keys wanted, each a column or a
/// sub-object; `seen` numbers them all, so that a key repeated in one record is caught.
struct Node {
    keys: Vec<Vec<u8>>,
    slots: Vec<Slot>,
}

enum Slot {
    Column(usize),
    Object(usize, Node),
    /// A sub-record none of whose columns is asked: still an object or null, or the record does
    /// not fit (row by row it is unreadable whatever the columns asked)
    Check,
}

impl Node {
    fn insert(&mut self, path: &[String], column: usize, objects: &mut usize) -> PyResult<()> {
        let (first, rest) = path
            .split_first()
            .ok_or_else(|| PyValueError::new_err("an empty path"))?;
        let found = self.keys.iter().position(|k| k == first.as_bytes());
        if rest.is_empty() {
            if found.is_some() {
                return Err(PyValueError::new_err(format!(
                    "two columns at the key {first:?}"
                )));
            }
            self.keys.push(first.as_bytes().to_vec());
            self.slots.push(Slot::Column(column));
            return Ok(());
        }
        let index = match found {
            Some(i) => i,
            None => {
                self.keys.push(first.as_bytes().to_vec());
                self.slots.push(Slot::Object(
                    usize::MAX,
                    Node {
                        keys: vec![],
                        slots: vec![],
                    },
                ));
                *objects += 1;
                self.keys.len() - 1
            }
        };
        match &mut self.slots[index] {
            Slot::Object(_, node) => node.insert(rest, column, objects),
            Slot::Column(_) | Slot::Check => Err(PyValueError::new_err(format!(
                "{first:?} is both a column and an object"
            ))),
        }
    }

    /// A sub-record at `path` that must be an object or null (checked, not read, when none of its
    /// columns is asked).
    fn check(&mut self, path: &[String]) -> PyResult<()> {
        let (first, rest) = path
            .split_first()
            .ok_or_else(|| PyValueError::new_err("an empty path"))?;
        let found = self.keys.iter().position(|k| k == first.as_bytes());
        let index = match found {
            Some(i) => i,
            None => {
                self.keys.push(first.as_bytes().to_vec());
                self.slots.push(Slot::Check);
                self.keys.len() - 1
            }
        };
        if rest.is_empty() {
            return match self.slots[index] {
                Slot::Column(_) => Err(PyValueError::new_err(format!(
                    "{first:?} is both a column and an object"
                ))),
                _ => Ok(()),
            };
        }
        if matches!(self.slots[index], Slot::Check) {
            // an object with sub-records to check in it, and no columns
            self.slots[index] = Slot::Object(
                usize::MAX,
                Node {
                    keys: vec![],
                    slots: vec![],
                },
            );
        }
        match &mut self.slots[index] {
            Slot::Object(_, node) => node.check(rest),
            _ => Err(PyValueError::new_err(format!(
                "{first:?} is both a column and an object"
            ))),
        }
    }

    /// Numbers the sub-objects after the columns (`seen` has one flag for each).
    fn number(&mut self, next: &mut usize) {
        for slot in &mut self.slots {
            if let Slot::Object(id, node) = slot {
                *id = *next;
                *next += 1;
                node.number(next);
            }
        }
    }
}

/// How many ASCII digits `b` starts with: eight bytes at a time where there are eight (numbers
/// differ in length, so a byte-at-a-time loop mispredicts its exit on nearly every one).
#[inline]
fn digit_run(b: &[u8]) -> usize {
    let mut n = 0;
    while let Some(chunk) = b.get(n..n + 8) {
        let x = u64::from_le_bytes(chunk.try_into().unwrap_or([0; 8])) ^ 0x3030_3030_3030_3030;
        // a byte is a digit iff it is now 0..=9: then neither it nor it + 6 reaches its high nibble
        // (a carry out of a non-digit byte only disturbs the bytes after it, which are not counted)
        let stops = (x | x.wrapping_add(0x0606_0606_0606_0606)) & 0xF0F0_F0F0_F0F0_F0F0;
        if stops != 0 {
            return n + (stops.trailing_zeros() / 8) as usize;
        }
        n += 8;
    }
    n + b[n..].iter().take_while(|c| c.is_ascii_digit()).count()
}

/// The value of 8 ASCII digits read as a little-endian u64, the first digit in the lowest byte;
/// zero bytes count as leading zeros (so fewer digits, shifted up, read the same).
#[inline]
fn eight_digits(x: u64) -> u64 {
    let x = ((x & 0x0F0F_0F0F_0F0F_0F0F).wrapping_mul(2561)) >> 8;
    let x = ((x & 0x00FF_00FF_00FF_00FF).wrapping_mul(6_553_601)) >> 16;
    ((x & 0x0000_FFFF_0000_FFFF).wrapping_mul(42_949_672_960_001)) >> 32
}

/// 10^0 ..= 10^22: the powers of ten a double holds exactly.
const POWERS_OF_TEN: [f64; 23] = [
    1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15, 1e16, 1e17,
    1e18, 1e19, 1e20, 1e21, 1e22,
];

/// The value of up to 19 ASCII digits, eight at a time.
#[inline]
fn many_digits(digits: &[u8]) -> u64 {
    let mut chunks = digits.chunks_exact(8);
    let mut value = 0;
    for chunk in &mut chunks {
        value = value * 100_000_000 + eight_digits(u64::from_le_bytes(chunk.try_into().unwrap_or([0; 8])));
    }
    chunks
        .remainder()
        .iter()
        .fold(value, |value, &c| value * 10 + u64::from(c - b'0'))
}

/// The value of up to 19 ASCII digits.
#[inline]
fn digits_value(digits: &[u8]) -> u64 {
    digits
        .iter()
        .fold(0, |value, &c| value * 10 + u64::from(c - b'0'))
}

// --- the parser ----------------------------------------------------------------------------------

struct Parser<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Parser<'a> {
    #[inline]
    fn ws(&mut self) {
        while let Some(&c) = self.b.get(self.i) {
            if c == b' ' || c == b'\n' || c == b'\r' || c == b'\t' {
                self.i += 1;
            } else {
                break;
            }
        }
    }

    #[inline]
    fn peek(&mut self) -> Res<u8> {
        self.ws();
        self.b
            .get(self.i)
            .copied()
            .ok_or("unexpected end of the record")
    }

    #[inline]
    fn expect(&mut self, c: u8) -> Res<()> {
        if self.peek()? == c {
            self.i += 1;
            Ok(())
        } else {
            Err(match c {
                b'{' => "expected an object",
                b'[' => "expected a list",
                b':' => "expected ':'",
                _ => "unexpected character",
            })
        }
    }

    fn literal(&mut self, word: &[u8]) -> Res<()> {
        if self.b[self.i..].starts_with(word) {
            self.i += word.len();
            Ok(())
        } else {
            Err("not JSON")
        }
    }

    /// A null, consumed (after whitespace).
    #[inline]
    fn null(&mut self) -> Res<bool> {
        if self.peek()? == b'n' {
            self.literal(b"null")?;
            Ok(true)
        } else {
            Ok(false)
        }
    }

    /// After an item of an object or list: true if another follows.
    #[inline]
    fn more(&mut self, close: u8) -> Res<bool> {
        let c = self.peek()?;
        self.i += 1;
        if c == b',' {
            Ok(true)
        } else if c == close {
            Ok(false)
        } else {
            Err("expected ',' or the end of an object or list")
        }
    }

    /// Opens an object or list: false if it is empty (and closed already).
    #[inline]
    fn open(&mut self, open: u8, close: u8) -> Res<bool> {
        self.expect(open)?;
        if self.peek()? == close {
            self.i += 1;
            return Ok(false);
        }
        Ok(true)
    }

    fn int(&mut self) -> Res<i64> {
        self.ws();
        let b = self.b;
        let negative = b.get(self.i) == Some(&b'-');
        let start = self.i + usize::from(negative);
        let digits = digit_run(&b[start.min(b.len())..]);
        let i = start + digits;
        if digits == 0 {
            return Err("expected an int");
        }
        if matches!(b.get(i), Some(b'.' | b'e' | b'E')) {
            return Err("a float where an int is due");
        }
        if digits > 1 && b[start] == b'0' {
            return Err("not JSON: a number with a leading zero");
        }
        if digits > 19 {
            return Err("an int beyond 64 bits");
        }
        let value = match b.get(start..start + 8) {
            // fewer than 8 digits with 8 bytes to read: all at once (token ids)
            Some(chunk) if digits < 8 => eight_digits(
                u64::from_le_bytes(chunk.try_into().unwrap_or([0; 8])) << (8 * (8 - digits)),
            ),
            _ => digits_value(&b[start..i]), // 19 digits fit a u64
        };
        self.i = i;
        if negative {
            if value > 1 << 63 {
                return Err("an int beyond 64 bits");
            }
            Ok((value as i64).wrapping_neg())
        } else {
            i64::try_from(value).map_err(|_| "an int beyond 64 bits")
        }
    }

    /// A JSON number's text (checked against the grammar).
    fn number(&mut self) -> Res<&'a [u8]> {
        self.ws();
        let b = self.b;
        let start = self.i;
        let mut i = self.i;
        let digits = |i: &mut usize| {
            let n = digit_run(&b[(*i).min(b.len())..]);
            *i += n;
            n
        };
        if b.get(i) == Some(&b'-') {
            i += 1;
        }
        let int_start = i;
        match digits(&mut i) {
            0 => return Err("expected a number"),
            n if n > 1 && b[int_start] == b'0' => {
                return Err("not JSON: a number with a leading zero");
            }
            _ => {}
        }
        if b.get(i) == Some(&b'.') {
            i += 1;
            if digits(&mut i) == 0 {
                return Err("not JSON: a number");
            }
        }
        if matches!(b.get(i), Some(b'e' | b'E')) {
            i += 1;
            if matches!(b.get(i), Some(b'+' | b'-')) {
                i += 1;
            }
            if digits(&mut i) == 0 {
                return Err("not JSON: a number");
            }
        }
        self.i = i;
        Ok(&b[start..i])
    }

    fn float(&mut self) -> Res<f64> {
        let text = self.number()?;
        // SAFETY: the grammar above lets through ASCII only
        let value: f64 = unsafe { std::str::from_utf8_unchecked(text) }
            .parse()
            .map_err(|_| "expected a number")?;
        if value.is_finite() {
            Ok(value)
        } else {
            Err("a float beyond 64 bits")
        }
    }

    /// A list's next item if it is an int as orjson writes most (1 to 7 digits, no sign, no leading
    /// zero) followed by `,` or `]`, both consumed: a token id in one 8-byte read. None: anything else
    /// (whitespace, a sign, a null, the record's last bytes), left to `int`, nothing consumed.
    #[inline]
    fn compact_int(&mut self) -> Option<(i64, u8)> {
        let chunk = self.b.get(self.i..self.i + 8)?;
        let x = u64::from_le_bytes(chunk.try_into().ok()?);
        let y = x ^ 0x3030_3030_3030_3030;
        let stops = (y | y.wrapping_add(0x0606_0606_0606_0606)) & 0xF0F0_F0F0_F0F0_F0F0;
        let digits = (stops.trailing_zeros() / 8) as usize; // 8 when all eight are digits
        if digits == 0 || digits == 8 || (digits > 1 && chunk[0] == b'0') {
            return None;
        }
        let stop = chunk[digits];
        if stop != b',' && stop != b']' {
            return None;
        }
        self.i += digits + 1;
        Some((eight_digits(x << (8 * (8 - digits))) as i64, stop))
    }

    /// A list's next item if it is a float as orjson writes most (`-0.8444218515250481`: digits, a
    /// point, digits, no exponent) followed by `,` or `]`, both consumed, when its digits read as one
    /// integer are at most 2^53 and the fraction has at most 22 digits: then both that integer and
    /// 10^digits are exact doubles, and the one division rounds correctly, to the same double as the
    /// full parser's (Clinger's fast path). None: anything else, left to `float`, nothing consumed.
    #[inline]
    fn compact_float(&mut self) -> Option<(f64, u8)> {
        let b = self.b;
        let negative = b.get(self.i) == Some(&b'-');
        let start = self.i + usize::from(negative);
        let whole = digit_run(b.get(start..)?);
        if whole == 0 || (whole > 1 && b[start] == b'0') || b.get(start + whole) != Some(&b'.') {
            return None;
        }
        let fraction_start = start + whole + 1;
        let fraction = digit_run(b.get(fraction_start..)?);
        let end = fraction_start + fraction;
        if fraction == 0 || whole + fraction > 19 || fraction >= POWERS_OF_TEN.len() {
            return None;
        }
        let stop = *b.get(end)?;
        if stop != b',' && stop != b']' {
            return None;
        }
        // at most 19 digits: below 10^19, within a u64
        let digits = many_digits(&b[start..start + whole]) * 10u64.pow(fraction as u32)
            + many_digits(&b[fraction_start..end]);
        if digits > 1 << 53 {
            return None;
        }
        let value = digits as f64 / POWERS_OF_TEN[fraction];
        self.i = end + 1;
        Some((if negative { -value } else { value }, stop))
    }

    fn bool(&mut self) -> Res<bool> {
        match self.peek()? {
            b't' => self.literal(b"true").map(|_| true),
            b'f' => self.literal(b"false").map(|_| false),
            _ => Err("expected true or false"),
        }
    }

    /// A string's bytes unescaped into `out`, checked to be UTF-8.
    fn string_into(&mut self, out: &mut Vec<u8>) -> Res<()> {
        self.expect_quote()?;
        loop {
            let run = self.i;
            self.run()?;
            out.extend_from_slice(&self.b[run..self.i]);
            match self.b.get(self.i) {
                Some(b'"') => {
                    self.i += 1;
                    return Ok(());
                }
                Some(b'\\') => self.escape(out)?,
                Some(_) => return Err("not JSON: a control character in a string"),
                None => return Err("unexpected end of the record in a string"),
            }
        }
    }

    fn expect_quote(&mut self) -> Res<()> {
        if self.peek()? == b'"' {
            self.i += 1;
            Ok(())
        } else {
            Err("expected a string")
        }
    }

    fn escape(&mut self, out: &mut Vec<u8>) -> Res<()> {
        let c = *self
            .b
            .get(self.i + 1)
            .ok_or("unexpected end of the record in a string")?;
        self.i += 2;
        let byte = match c {
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
                    if !self.b[self.i..].starts_with(b"\\u") {
                        return Err("a lone surrogate in a string");
                    }
                    self.i += 2;
                    let low = self.hex4()?;
                    if !(0xDC00..0xE000).contains(&low) {
                        return Err("a lone surrogate in a string");
                    }
                    code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00);
                } else if (0xDC00..0xE000).contains(&code) {
                    return Err("a lone surrogate in a string");
                }
                let ch = char::from_u32(code).ok_or("a bad \\u escape")?;
                out.extend_from_slice(ch.encode_utf8(&mut [0; 4]).as_bytes());
                return Ok(());
            }
            _ => return Err("not JSON: a bad escape in a string"),
        };
        out.push(byte);
        Ok(())
    }

    fn hex4(&mut self) -> Res<u32> {
        let digits = self.b.get(self.i..self.i + 4).ok_or("a bad \\u escape")?;
        let mut code = 0;
        for &d in digits {
            code = code * 16 + (d as char).to_digit(16).ok_or("a bad \\u escape")?;
        }
        self.i += 4;
        Ok(code)
    }

    /// An object's key and the colon after it; the key borrowed from the record unless it has escapes.
    #[inline]
    fn key(&mut self) -> Res<Cow<'a, [u8]>> {
        self.expect_quote()?;
        let start = self.i;
        self.run()?;
        if self.b.get(self.i) == Some(&b'"') {
            let end = self.i;
            self.i += 1;
            self.expect(b':')?;
            return Ok(Cow::Borrowed(&self.b[start..end]));
        }
        self.i = start - 1;
        let mut out = Vec::new();
        self.string_into(&mut out)?;
        self.expect(b':')?;
        Ok(Cow::Owned(out))
    }

    /// Moves past the plain bytes of a string (up to a quote, a backslash or a control character),
    /// checking that they are UTF-8: outside strings the grammar lets through ASCII only.
    #[inline]
    fn run(&mut self) -> Res<()> {
        let start = self.i;
        let mut high = 0;
        while let Some(&c) = self.b.get(self.i) {
            if c == b'"' || c == b'\\' || c < 0x20 {
                break;
            }
            high |= c;
            self.i += 1;
        }
        if high >= 0x80 && std::str::from_utf8(&self.b[start..self.i]).is_err() {
            return Err("not UTF-8");
        }
        Ok(())
    }

    /// Checks a value of any kind and moves past it.
    fn skip(&mut self, depth: usize) -> Res<()> {
        if depth > MAX_DEPTH {
            return Err("nested too deep");
        }
        match self.peek()? {
            b'{' => {
                if self.open(b'{', b'}')? {
                    loop {
                        self.key()?;
                        self.skip(depth + 1)?;
                        if !self.more(b'}')? {
                            break;
                        }
                    }
                }
                Ok(())
            }
            b'[' => {
                if self.open(b'[', b']')? {
                    loop {
                        // numbers (token ids, logprobs a query did not ask for) checked here, not recursing;
                        // most in one step, with their separator
                        match self.b.get(self.i) {
                            Some(b'-' | b'0'..=b'9') => {
                                let quick = match self.compact_int() {
                                    None => self.compact_float().map(|(_, stop)| stop),
                                    found => found.map(|(_, stop)| stop),
                                };
                                match quick {
                                    Some(b']') => break,
                                    Some(_) => continue,
                                    None => self.number().map(|_| ())?,
                                }
                            }
                            _ => self.skip(depth + 1)?,
                        }
                        if !self.more(b']')? {
                            break;
                        }
                    }
                }
                Ok(())
            }
            b'"' => self.skip_string(),
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            _ => self.number().map(|_| ()),
        }
    }

    /// Whether no whitespace is here (what orjson writes has none outside strings).
    #[inline]
    fn tight(&self) -> bool {
        !matches!(self.b.get(self.i), Some(b' ' | b'\n' | b'\r' | b'\t'))
    }

    /// Checks a value of any kind and moves past it, like `skip`; true if its text is what orjson
    /// writes for it (compact, orjson's escapes, no float, no repeated key, an int within 64 bits),
    /// so that `orjson.dumps(orjson.loads(text)) == text` holds without asking orjson.
    fn raw(&mut self, depth: usize, keys: &mut Vec<(usize, usize)>) -> Res<bool> {
        if depth > MAX_DEPTH {
            return Err("nested too deep");
        }
        let mut plain = self.tight();
        match self.peek()? {
            b'{' => {
                self.i += 1;
                plain &= self.tight();
                if self.peek()? == b'}' {
                    self.i += 1;
                    return Ok(plain);
                }
                let mark = keys.len();
                loop {
                    plain &= self.tight();
                    self.ws();
                    let start = self.i;
                    plain &= self.raw_string()?;
                    let key = &self.b[start..self.i];
                    if keys[mark..].iter().any(|&(s, e)| &self.b[s..e] == key) {
                        plain = false; // orjson keeps the last value only
                    }
                    keys.push((start, self.i));
                    plain &= self.tight();
                    self.expect(b':')?;
                    plain &= self.raw(depth + 1, keys)?;
                    plain &= self.tight();
                    if !self.more(b'}')? {
                        break;
                    }
                }
                keys.truncate(mark);
                Ok(plain)
            }
            b'[' => {
                self.i += 1;
                plain &= self.tight();
                if self.peek()? == b']' {
                    self.i += 1;
                    return Ok(plain);
                }
                loop {
                    plain &= self.raw(depth + 1, keys)?;
                    plain &= self.tight();
                    if !self.more(b']')? {
                        break;
                    }
                }
                Ok(plain)
            }
            b'"' => Ok(self.raw_string()? && plain),
            b't' => self.literal(b"true").map(|_| plain),
            b'f' => self.literal(b"false").map(|_| plain),
            b'n' => self.literal(b"null").map(|_| plain),
            _ => {
                let text = self.number()?;
                Ok(plain && plain_int(text))
            }
        }
    }

    /// A string checked and moved past; true if its escapes are the ones orjson writes: `\"`, `\\`,
    /// `\b \f \n \r \t`, and `\u00xx` (lowercase) for the other control characters.
    fn raw_string(&mut self) -> Res<bool> {
        self.expect_quote()?;
        let mut plain = true;
        let mut sink = Vec::new();
        loop {
            self.run()?;
            match self.b.get(self.i) {
                Some(b'"') => {
                    self.i += 1;
                    return Ok(plain);
                }
                Some(b'\\') => {
                    plain &= match self.b.get(self.i + 1) {
                        Some(b'"' | b'\\' | b'b' | b'f' | b'n' | b'r' | b't') => true,
                        Some(b'u') => match self.b.get(self.i + 2..self.i + 6) {
                            Some([b'0', b'0', high @ (b'0' | b'1'), low]) => {
                                let code = (high - b'0') * 16
                                    + (*low as char).to_digit(16).unwrap_or(99) as u8;
                                !low.is_ascii_uppercase()
                                    && code < 0x20
                                    && !matches!(code, 8 | 9 | 10 | 12 | 13)
                            }
                            _ => false,
                        },
                        _ => false,
                    };
                    sink.clear();
                    self.escape(&mut sink)?;
                }
                Some(_) => return Err("not JSON: a control character in a string"),
                None => return Err("unexpected end of the record in a string"),
            }
        }
    }

    fn skip_string(&mut self) -> Res<()> {
        self.expect_quote()?;
        loop {
            self.run()?;
            match self.b.get(self.i) {
                Some(b'"') => {
                    self.i += 1;
                    return Ok(());
                }
                Some(b'\\') => {
                    let mut sink = Vec::new();
                    self.escape(&mut sink)?;
                }
                Some(_) => return Err("not JSON: a control character in a string"),
                None => return Err("unexpected end of the record in a string"),
            }
        }
    }
}

/// Whether orjson writes this JSON number the same: an int (no fraction, no exponent), not `-0`,
/// within what orjson keeps as an int (-2^63 ..= 2^64 - 1; beyond, a float).
fn plain_int(text: &[u8]) -> bool {
    if text.iter().any(|c| matches!(c, b'.' | b'e' | b'E')) || text == b"-0" || text.len() > 21 {
        return false;
    }
    // SAFETY: ASCII, checked by the grammar
    let value: i128 = match unsafe { std::str::from_utf8_unchecked(text) }.parse() {
        Ok(v) => v,
        Err(_) => return false,
    };
    (-(1i128 << 63)..=u64::MAX as i128).contains(&value)
}

/// Room for `extra` more values; a large buffer backed by huge pages where the kernel has them
/// (`madvise` mode): each 4 kB page faulted in and zeroed on first touch costs more than parsing it.
fn huge<T>(values: &mut Vec<T>, extra: usize) {
    values.reserve(extra);
    let bytes = values.capacity() * std::mem::size_of::<T>();
    if bytes >= 4 << 20 {
        const HUGE: usize = 2 << 20;
        let start = (values.as_ptr() as usize).next_multiple_of(HUGE);
        let end = (values.as_ptr() as usize + bytes) / HUGE * HUGE;
        if end > start {
            // SAFETY: advice only, on whole huge pages inside the buffer's allocation
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        }
    }
}

// --- the column builders -------------------------------------------------------------------------

/// Text as Arrow's string views, the layout polars keeps strings in (so it takes the column as it is,
/// where offsets and bytes would be converted, a copy of every text): each row a 16-byte view, its
/// text inline when it has at most 12 bytes, else its length, first 4 bytes and place in a buffer.
struct Views {
    views: Vec<u128>,
    /// the buffer being written
    data: Vec<u8>,
    /// the buffers written before (a view's offset into its buffer is 32 bits: up to 4 GiB each)
    full: Vec<Buffer>,
}

impl Views {
    fn new(capacity: usize) -> Views {
        Views {
            views: Vec::with_capacity(capacity),
            data: Vec::new(),
            full: vec![],
        }
    }

    /// The view of the text written to `data` from `start` on (moved into the view if it fits).
    #[inline]
    fn close(&mut self, start: usize) {
        let len = self.data.len() - start;
        if len <= 12 {
            let mut inline = [0u8; 16];
            inline[..4].copy_from_slice(&(len as u32).to_le_bytes());
            inline[4..4 + len].copy_from_slice(&self.data[start..]);
            self.data.truncate(start);
            self.views.push(u128::from_le_bytes(inline));
            return;
        }
        let mut start = start;
        if self.data.len() > u32::MAX as usize {
            // the text starts a buffer of its own
            let text = self.data.split_off(start);
            self.full
                .push(Buffer::from_vec(std::mem::replace(&mut self.data, text)));
            start = 0;
        }
        let prefix = u32::from_le_bytes(
            self.data[start..start + 4]
                .try_into()
                .unwrap_or([0; 4]),
        );
        self.views.push(
            len as u128
                | u128::from(prefix) << 32
                | (self.full.len() as u128) << 64
                | (start as u128) << 96,
        );
    }

    fn finish(self) -> arrow_data::ArrayDataBuilder {
        let Views {
            views,
            data,
            mut full,
        } = self;
        full.push(Buffer::from_vec(data));
        ArrayData::builder(DataType::Utf8View)
            .len(views.len())
            .add_buffer(Buffer::from_vec(views))
            .add_buffers(full)
    }
}

enum Builder {
    Int {
        values: Vec<i64>,
        nulls: NullBufferBuilder,
    },
    Float {
        values: Vec<f64>,
        nulls: NullBufferBuilder,
    },
    Bool {
        values: BooleanBufferBuilder,
        nulls: NullBufferBuilder,
    },
    /// text, or (`raw`) any JSON value as its text
    /// (`recode`: the rows whose JSON text orjson would write otherwise)
    Str {
        text: Views,
        nulls: NullBufferBuilder,
        raw: bool,
        recode: Vec<u32>,
        keys: Vec<(usize, usize)>,
    },
    List {
        offsets: Vec<i64>,
        nulls: NullBufferBuilder,
        item: Box<Builder>,
        kind: Kind,
    },
    Struct {
        keys: Vec<Vec<u8>>,
        members: Vec<Builder>,
        nulls: NullBufferBuilder,
        kind: Kind,
        seen: Vec<bool>,
    },
}

impl Builder {
    fn new(kind: &Kind, capacity: usize) -> Builder {
        let nulls = NullBufferBuilder::new(capacity);
        match kind {
            Kind::Int => Builder::Int {
                values: Vec::with_capacity(capacity),
                nulls,
            },
            Kind::Float => Builder::Float {
                values: Vec::with_capacity(capacity),
                nulls,
            },
            Kind::Bool => Builder::Bool {
                values: BooleanBufferBuilder::new(capacity),
                nulls,
            },
            Kind::Str | Kind::Json => Builder::Str {
                text: Views::new(capacity),
                nulls,
                raw: matches!(kind, Kind::Json),
                recode: Vec::new(),
                keys: Vec::new(),
            },
            Kind::List(item) => Builder::List {
                offsets: {
                    let mut o = Vec::with_capacity(capacity + 1);
                    o.push(0);
                    o
                },
                nulls,
                item: Box::new(Builder::new(item, capacity)),
                kind: kind.clone(),
            },
            Kind::Struct(members) => Builder::Struct {
                keys: members
                    .iter()
                    .map(|(name, _)| name.as_bytes().to_vec())
                    .collect(),
                members: members
                    .iter()
                    .map(|(_, k)| Builder::new(k, capacity))
                    .collect(),
                nulls,
                kind: kind.clone(),
                seen: vec![false; members.len()],
            },
        }
    }

    fn len(&self) -> usize {
        match self {
            Builder::Int { values, .. } => values.len(),
            Builder::Float { values, .. } => values.len(),
            Builder::Bool { values, .. } => values.len(),
            Builder::Str { text, .. } => text.views.len(),
            Builder::List { offsets, .. } => offsets.len() - 1,
            Builder::Struct { nulls, .. } => nulls.len(),
        }
    }

    /// Room for the items of a batch of `total` records, from the first `done` (one allocation
    /// instead of doubling: the token lists are most of a batch's bytes).
    fn reserve(&mut self, done: usize, total: usize) {
        let room = |len: usize| len / done.max(1) * (total - done) + len / done.max(1) * total / 8;
        match self {
            Builder::List { item, .. } => {
                let extra = room(item.len());
                match item.as_mut() {
                    Builder::Int { values, .. } => huge(values, extra),
                    Builder::Float { values, .. } => huge(values, extra),
                    _ => {}
                }
            }
            Builder::Str { text, .. } => {
                let extra = room(text.data.len());
                huge(&mut text.data, extra)
            }
            _ => {}
        }
    }

    fn push_null(&mut self) {
        match self {
            Builder::Int { values, nulls } => {
                values.push(0);
                nulls.append_null();
            }
            Builder::Float { values, nulls } => {
                values.push(0.0);
                nulls.append_null();
            }
            Builder::Bool { values, nulls } => {
                values.append(false);
                nulls.append_null();
            }
            Builder::Str { text, nulls, .. } => {
                text.views.push(0);
                nulls.append_null();
            }
            Builder::List { offsets, nulls, .. } => {
                offsets.push(*offsets.last().unwrap_or(&0));
                nulls.append_null();
            }
            Builder::Struct { members, nulls, .. } => {
                members.iter_mut().for_each(Builder::push_null);
                nulls.append_null();
            }
        }
    }

    /// The next value of the record, of this column's kind, or null.
    fn push(&mut self, p: &mut Parser<'_>) -> Res<()> {
        if p.null()? {
            self.push_null();
            return Ok(());
        }
        match self {
            Builder::Int { values, nulls } => {
                values.push(p.int()?);
                nulls.append_non_null();
            }
            Builder::Float { values, nulls } => {
                values.push(p.float()?);
                nulls.append_non_null();
            }
            Builder::Bool { values, nulls } => {
                values.append(p.bool()?);
                nulls.append_non_null();
            }
            Builder::Str {
                text,
                nulls,
                raw,
                recode,
                keys,
            } => {
                let start = text.data.len();
                if *raw {
                    p.ws();
                    let from = p.i;
                    if !p.raw(0, keys)? {
                        recode.push(text.views.len() as u32);
                    }
                    text.data.extend_from_slice(&p.b[from..p.i]);
                } else {
                    p.string_into(&mut text.data)?;
                }
                text.close(start);
                nulls.append_non_null();
            }
            Builder::List {
                offsets,
                nulls,
                item,
                ..
            } => {
                if p.open(b'[', b']')? {
                    // token ids and logprobs, most of a call's bytes: a loop of their own
                    match item.as_mut() {
                        Builder::Int { values, nulls } => loop {
                            if let Some((value, stop)) = p.compact_int() {
                                values.push(value);
                                nulls.append_non_null();
                                if stop == b']' {
                                    break;
                                }
                                continue;
                            }
                            if p.null()? {
                                values.push(0);
                                nulls.append_null();
                            } else {
                                values.push(p.int()?);
                                nulls.append_non_null();
                            }
                            if !p.more(b']')? {
                                break;
                            }
                        },
                        Builder::Float { values, nulls } => loop {
                            if let Some((value, stop)) = p.compact_float() {
                                values.push(value);
                                nulls.append_non_null();
                                if stop == b']' {
                                    break;
                                }
                                continue;
                            }
                            if p.null()? {
                                values.push(0.0);
                                nulls.append_null();
                            } else {
                                values.push(p.float()?);
                                nulls.append_non_null();
                            }
                            if !p.more(b']')? {
                                break;
                            }
                        },
                        item => loop {
                            item.push(p)?;
                            if !p.more(b']')? {
                                break;
                            }
                        },
                    }
                }
                offsets.push(item.len() as i64);
                nulls.append_non_null();
            }
            Builder::Struct {
                keys,
                members,
                nulls,
                seen,
                ..
            } => {
                seen.iter_mut().for_each(|s| *s = false);
                if p.open(b'{', b'}')? {
                    loop {
                        let key = p.key()?;
                        match keys.iter().position(|k| **k == *key) {
                            Some(m) => {
                                if seen[m] {
                                    return Err("a key repeated in an object");
                                }
                                seen[m] = true;
                                members[m].push(p)?;
                            }
                            None => p.skip(1)?,
                        }
                        if !p.more(b'}')? {
                            break;
                        }
                    }
                }
                for (member, seen) in members.iter_mut().zip(seen.iter()) {
                    if !seen {
                        member.push_null();
                    }
                }
                nulls.append_non_null();
            }
        }
        Ok(())
    }

    fn finish(self) -> ArrayData {
        let (builder, nulls) = match self {
            Builder::Int { values, nulls } => (
                ArrayData::builder(DataType::Int64)
                    .len(values.len())
                    .add_buffer(Buffer::from_vec(values)),
                nulls,
            ),
            Builder::Float { values, nulls } => (
                ArrayData::builder(DataType::Float64)
                    .len(values.len())
                    .add_buffer(Buffer::from_vec(values)),
                nulls,
            ),
            Builder::Bool { mut values, nulls } => {
                let len = values.len();
                (
                    ArrayData::builder(DataType::Boolean)
                        .len(len)
                        .add_buffer(values.finish().into_inner()),
                    nulls,
                )
            }
            Builder::Str { text, nulls, .. } => (text.finish(), nulls),
            Builder::List {
                offsets,
                nulls,
                item,
                kind,
            } => (
                ArrayData::builder(kind.data_type())
                    .len(offsets.len() - 1)
                    .add_buffer(Buffer::from_vec(offsets))
                    .add_child_data(item.finish()),
                nulls,
            ),
            Builder::Struct {
                members,
                nulls,
                kind,
                ..
            } => {
                let len = nulls.len();
                (
                    ArrayData::builder(kind.data_type())
                        .len(len)
                        .child_data(members.into_iter().map(Builder::finish).collect()),
                    nulls,
                )
            }
        };
        let mut nulls = nulls;
        let built = builder.nulls(nulls.finish());
        // SAFETY: the buffers are as the type needs them: offsets from 0, rising, within the data; views
        // of whole texts within their buffers; text from records checked to be UTF-8, cut at whole
        // characters; as many values as the length
        unsafe { built.build_unchecked() }
    }
}

// --- a batch -------------------------------------------------------------------------------------

struct Batch<'n> {
    root: &'n Node,
    columns: Vec<Builder>,
    seen: Vec<bool>,
}

impl Batch<'_> {
    /// One record into the columns; on failure, where and why.
    fn record(&mut self, value: &[u8]) -> Result<(), (usize, &'static str)> {
        let mut p = Parser { b: value, i: 0 };
        self.fill(&mut p).map_err(|why| (p.i, why))
    }

    fn fill(&mut self, p: &mut Parser<'_>) -> Res<()> {
        let value = p.b;
        self.seen.iter_mut().for_each(|s| *s = false);
        if p.peek()? != b'{' {
            return Err("not a JSON object");
        }
        object(p, self.root, &mut self.columns, &mut self.seen, 0)?;
        p.ws();
        if p.i != value.len() {
            return Err("not JSON: more after the record");
        }
        for (column, seen) in self.columns.iter_mut().zip(self.seen.iter()) {
            if !seen {
                column.push_null();
            }
        }
        Ok(())
    }
}

/// An object holding columns at some of its keys (null: all of them null).
fn object(
    p: &mut Parser<'_>,
    node: &Node,
    columns: &mut [Builder],
    seen: &mut [bool],
    depth: usize,
) -> Res<()> {
    if p.null()? || !p.open(b'{', b'}')? {
        return Ok(());
    }
    // one writer writes the keys in one order: the key after the last one found is tried first
    let mut next = 0;
    loop {
        let key = p.key()?;
        let found = match node.keys.get(next) {
            Some(k) if **k == *key => Some(next),
            _ => node.keys.iter().position(|k| **k == *key),
        };
        if let Some(at) = found {
            next = at + 1;
        }
        match found {
            // a repeat is not caught here, as for a key not asked (orjson keeps the last)
            Some(at) if matches!(node.slots[at], Slot::Check) => {
                if !p.null()? {
                    if p.peek()? != b'{' {
                        return Err("expected an object");
                    }
                    p.skip(depth + 1)?;
                }
            }
            Some(at) => {
                let id = match &node.slots[at] {
                    Slot::Column(c) | Slot::Object(c, _) => *c,
                    Slot::Check => unreachable!(),
                };
                if seen[id] {
                    return Err("a key repeated in an object");
                }
                seen[id] = true;
                match &node.slots[at] {
                    Slot::Column(c) => columns[*c].push(p)?,
                    Slot::Object(_, sub) => object(p, sub, columns, seen, depth + 1)?,
                    Slot::Check => unreachable!(),
                }
            }
            None => p.skip(depth + 1)?,
        }
        if !p.more(b'}')? {
            return Ok(());
        }
    }
}

/// Per JSON column with such rows, the rows whose text orjson would write otherwise.
type Recode = Vec<(String, Vec<u32>)>;

/// Each record's place in the log, as columns after the ones asked for.
const KAFKA_COLUMNS: [&str; 3] = ["kafka_partition", "kafka_offset", "kafka_timestamp"];

// --- Python --------------------------------------------------------------------------------------

/// Reads batches of records into the columns it was made for (see the module's docs).
#[pyclass(frozen)]
struct Decoder {
    root: Node,
    names: Vec<String>,
    kinds: Vec<Kind>,
    flags: usize,
}

#[pymethods]
impl Decoder {
    #[new]
    #[pyo3(signature = (columns, objects = vec![]))]
    fn new(
        columns: Vec<(String, Vec<String>, Bound<'_, PyAny>)>,
        objects: Vec<Vec<String>>,
    ) -> PyResult<Self> {
        let mut root = Node {
            keys: vec![],
            slots: vec![],
        };
        let mut count = 0;
        let mut names = vec![];
        let mut kinds = vec![];
        for (i, (name, path, kind)) in columns.iter().enumerate() {
            root.insert(path, i, &mut count)?;
            names.push(name.clone());
            kinds.push(Kind::from_py(kind)?);
        }
        let mut objects_in_order = objects;
        objects_in_order.sort_by_key(Vec::len); // an object before the ones in it
        for path in &objects_in_order {
            root.check(path)?;
        }
        let mut next = columns.len();
        root.number(&mut next);
        Ok(Decoder {
            root,
            names,
            kinds,
            flags: next,
        })
    }

    /// The records' columns as one Arrow struct array, and for each JSON column the rows whose text
    /// orjson would write otherwise (`[(name, rows)]`, only columns with such rows); ValueError if a
    /// record does not fit.
    fn decode(&self, py: Python<'_>, records: &Bound<'_, PyList>) -> PyResult<(Columns, Recode)> {
        let mut held: Vec<Option<Bound<'_, PyBytes>>> = Vec::with_capacity(records.len());
        let mut position = [
            Vec::with_capacity(records.len()),
            Vec::with_capacity(records.len()),
            Vec::with_capacity(records.len()),
        ];
        for record in records.iter() {
            // schemas.scan.Record: (topic, partition, offset, timestamp, key, value)
            let record = record.cast_into::<PyTuple>()?;
            for (column, at) in position.iter_mut().zip(1..4) {
                column.push(record.get_item(at)?.extract::<i64>()?);
            }
            let value = record.get_item(5)?;
            held.push(if value.is_none() {
                None
            } else {
                Some(value.cast_into::<PyBytes>()?)
            });
        }
        let slices: Vec<&[u8]> = held
            .iter()
            .map(|v| v.as_ref().map_or(&b"{}"[..], |b| b.as_bytes()))
            .collect();
        self.decode_slices(py, &slices, position)
    }

    /// Like `decode`, for what `take` kept of one fetch (no `Record` made for each message).
    fn decode_fetched(&self, py: Python<'_>, fetched: &Fetched) -> PyResult<(Columns, Recode)> {
        let slices: Vec<&[u8]> = fetched
            .values
            .iter()
            .map(|v| v.as_ref().map_or(&b"{}"[..], |b| b.as_bytes(py)))
            .collect();
        self.decode_slices(py, &slices, fetched.position.clone())
    }
}

impl Decoder {
    fn decode_slices(
        &self,
        py: Python<'_>,
        slices: &[&[u8]],
        position: [Vec<i64>; 3],
    ) -> PyResult<(Columns, Recode)> {
        let result = py.detach(|| self.columns(slices, position));
        match result {
            Ok((data, recode)) => Ok((Columns::new(data)?, recode)),
            Err((record, at, why)) => Err(PyValueError::new_err(format!(
                "record {record}, byte {at}: {why}"
            ))),
        }
    }
}

/// One fetch's messages in range, as `take` found them: each one's value and place in the log.
#[pyclass(frozen)]
struct Fetched {
    values: Vec<Option<Py<PyBytes>>>,
    /// partition, offset, timestamp
    position: [Vec<i64>; 3],
}

#[pymethods]
impl Fetched {
    fn __len__(&self) -> usize {
        self.values.len()
    }
}

/// What `take` returns: the messages kept (the list itself when all are), their values and places,
/// the messages that carry an error (a partition's end among them), and per partition the offset
/// after the last message kept.
type Taken<'py> = (
    Bound<'py, PyList>,
    Fetched,
    Vec<Bound<'py, PyAny>>,
    HashMap<i64, i64>,
);

/// Sorts the messages of one `Consumer.consume` (confluent-kafka's `Message`s): those with an error
/// apart, then those of a partition in `ends` before its end (partition → offset to stop before)
/// kept, the others dropped; in one pass, a few calls per message instead of a `Record` each.
#[pyfunction]
fn take<'py>(
    py: Python<'py>,
    messages: &Bound<'py, PyList>,
    ends: HashMap<i64, i64>,
) -> PyResult<Taken<'py>> {
    let n = messages.len();
    let mut values = Vec::with_capacity(n);
    let mut position = [
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    ];
    let mut errors = vec![];
    let mut positions = HashMap::new();
    let mut kept: Option<Vec<Bound<'py, PyAny>>> = None;
    for (i, message) in messages.iter().enumerate() {
        let keep = if !message.call_method0(intern!(py, "error"))?.is_none() {
            errors.push(message.clone());
            false
        } else {
            let partition: i64 = message.call_method0(intern!(py, "partition"))?.extract()?;
            let offset: i64 = message.call_method0(intern!(py, "offset"))?.extract()?;
            match ends.get(&partition) {
                Some(&end) if offset < end => {
                    let stamp = message.call_method0(intern!(py, "timestamp"))?;
                    let value = message.call_method0(intern!(py, "value"))?;
                    position[0].push(partition);
                    position[1].push(offset);
                    position[2].push(stamp.cast_into::<PyTuple>()?.get_item(1)?.extract()?);
                    values.push(if value.is_none() {
                        None
                    } else {
                        Some(value.cast_into::<PyBytes>()?.unbind())
                    });
                    positions.insert(partition, offset + 1);
                    true
                }
                _ => false,
            }
        };
        match (&mut kept, keep) {
            (Some(list), true) => list.push(message),
            (None, false) => kept = Some(messages.iter().take(i).collect()),
            _ => {}
        }
    }
    let kept = match kept {
        None => messages.clone(),
        Some(list) => PyList::new(py, list)?,
    };
    Ok((kept, Fetched { values, position }, errors, positions))
}

impl Decoder {
    fn columns(
        &self,
        values: &[&[u8]],
        position: [Vec<i64>; 3],
    ) -> Result<(ArrayData, Recode), (usize, usize, &'static str)> {
        let mut batch = Batch {
            root: &self.root,
            columns: self
                .kinds
                .iter()
                .map(|k| Builder::new(k, values.len()))
                .collect(),
            seen: vec![false; self.flags],
        };
        const SAMPLE: usize = 64;
        for (n, value) in values.iter().enumerate() {
            batch.record(value).map_err(|(at, why)| (n, at, why))?;
            if n + 1 == SAMPLE && values.len() > 2 * SAMPLE {
                batch
                    .columns
                    .iter_mut()
                    .for_each(|c| c.reserve(SAMPLE, values.len()));
            }
        }
        let mut fields: Vec<Field> = self
            .names
            .iter()
            .zip(&self.kinds)
            .map(|(name, kind)| Field::new(name, kind.data_type(), true))
            .collect();
        fields.extend(
            KAFKA_COLUMNS
                .iter()
                .map(|name| Field::new(*name, DataType::Int64, false)),
        );
        let mut recode = vec![];
        for (name, column) in self.names.iter().zip(&mut batch.columns) {
            if let Builder::Str { recode: rows, .. } = column
                && !rows.is_empty()
            {
                recode.push((name.clone(), std::mem::take(rows)));
            }
        }
        let mut children: Vec<ArrayData> = batch.columns.into_iter().map(Builder::finish).collect();
        for column in position {
            let len = column.len();
            let builder = ArrayData::builder(DataType::Int64)
                .len(len)
                .add_buffer(Buffer::from_vec(column));
            // SAFETY: one value per record, no nulls
            children.push(unsafe { builder.build_unchecked() });
        }
        let builder = ArrayData::builder(DataType::Struct(Fields::from(fields)))
            .len(values.len())
            .child_data(children);
        // SAFETY: every column has one value per record
        Ok((unsafe { builder.build_unchecked() }, recode))
    }
}

/// An Arrow struct array, handed over once through the Arrow PyCapsule interface.
#[pyclass]
struct Columns {
    data: Option<ArrayData>,
}

impl Columns {
    fn new(data: ArrayData) -> PyResult<Self> {
        Ok(Columns { data: Some(data) })
    }
}

#[pymethods]
impl Columns {
    #[pyo3(signature = (requested_schema=None))]
    fn __arrow_c_array__<'py>(
        &mut self,
        py: Python<'py>,
        requested_schema: Option<Bound<'py, PyAny>>,
    ) -> PyResult<(Bound<'py, PyCapsule>, Bound<'py, PyCapsule>)> {
        let _ = requested_schema; // the columns have the types asked for when the decoder was made
        let data = self
            .data
            .take()
            .ok_or_else(|| PyRuntimeError::new_err("the columns were handed over already"))?;
        let schema = FFI_ArrowSchema::try_from(data.data_type())
            .map_err(|e| PyRuntimeError::new_err(format!("arrow schema: {e}")))?;
        let array = FFI_ArrowArray::new(&data);
        Ok((
            PyCapsule::new_with_value(py, schema, c"arrow_schema")?,
            PyCapsule::new_with_value(py, array, c"arrow_array")?,
        ))
    }
}

#[pymodule]
fn agentstream_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Decoder>()?;
    m.add_class::<Columns>()?;
    m.add_class::<Fetched>()?;
    m.add_function(wrap_pyfunction!(take, m)?)?;
    m.add_class::<shapes::Shape>()?;
    Ok(())
}
