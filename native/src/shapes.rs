//! Whether records fit a model's shape exactly, checked in one pass without the GIL: what lets a
//! reader skip pydantic for a batch whose records all fit (`schemas/shapes.py` makes the shapes
//! from the models).
//!
//! `Shape(form)`: a form is "int", "float", "bool", "str", "any" (any JSON value; NaN does not fit),
//! ("range", low, high) (an int within),
//! ("literal", [texts]), ("optional", form) (or null), ("list", form), ("dict", form) (an object of
//! any keys, values of the form), or ("object", [(key, form, required), ...]) (those keys only,
//! the required ones present); the root is an object. `Shape.misfits(values)` (bytes, or None for an
//! empty record) and `Shape.misfits_fetched(fetched)` return the indices of the records that do not
//! fit; `Shape(form, take=[keys])`'s `check` and `check_fetched` also the texts at those keys of the
//! root (a str or optional str each: an id), in the same pass, so that a reader needing no more of a
//! record than them reads no column.
//!
//! Never looser than pydantic's strict validation of the model: where in doubt, a record does not
//! fit (a repeated key, an int beyond 64 bits, NaN, a float's int part of more than 18 digits, a
//! lone surrogate), and the caller decodes it with pydantic, which decides as before.

use std::collections::HashSet;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple};

use super::{Fetched, Parser, Res};

enum Form {
    Any,
    Int { low: i64, high: i64 },
    Float,
    Bool,
    Str,
    OneOf(Vec<Vec<u8>>),
    Nullable(Box<Form>),
    List(Box<Form>),
    Map(Box<Form>),
    Object(Vec<Member>),
}

struct Member {
    key: Vec<u8>,
    form: Form,
    required: bool,
}

fn unknown(tag: &str) -> PyErr {
    PyValueError::new_err(format!("unknown form {tag:?}"))
}

impl Form {
    fn from_py(obj: &Bound<'_, PyAny>) -> PyResult<Form> {
        if let Ok(name) = obj.cast::<PyString>() {
            return match name.to_str()? {
                "int" => Ok(Form::Int {
                    low: i64::MIN,
                    high: i64::MAX,
                }),
                "float" => Ok(Form::Float),
                "bool" => Ok(Form::Bool),
                "str" => Ok(Form::Str),
                "any" => Ok(Form::Any),
                other => Err(unknown(other)),
            };
        }
        let parts = obj.cast::<PyTuple>()?;
        let tag: String = parts.get_item(0)?.extract()?;
        let inner = || Form::from_py(&parts.get_item(1)?).map(Box::new);
        match tag.as_str() {
            "range" => Ok(Form::Int {
                low: parts.get_item(1)?.extract()?,
                high: parts.get_item(2)?.extract()?,
            }),
            "literal" => {
                let words: Vec<String> = parts.get_item(1)?.extract()?;
                Ok(Form::OneOf(words.into_iter().map(String::into_bytes).collect()))
            }
            "optional" => Ok(Form::Nullable(inner()?)),
            "list" => Ok(Form::List(inner()?)),
            "dict" => Ok(Form::Map(inner()?)),
            "object" => {
                let members: Vec<(String, Bound<'_, PyAny>, bool)> = parts.get_item(1)?.extract()?;
                if members.len() > 64 {
                    return Err(PyValueError::new_err("an object of more than 64 keys"));
                }
                let members = members
                    .iter()
                    .map(|(key, form, required)| {
                        Ok(Member {
                            key: key.clone().into_bytes(),
                            form: Form::from_py(form)?,
                            required: *required,
                        })
                    })
                    .collect::<PyResult<Vec<_>>>()?;
                Ok(Form::Object(members))
            }
            other => Err(unknown(other)),
        }
    }

    /// Moves past a value of this form; an error if it is not one.
    fn check(&self, p: &mut Parser<'_>, scratch: &mut Vec<u8>) -> Res<()> {
        match self {
            Form::Any => p.skip(1),
            Form::Nullable(inner) => {
                if p.null()? {
                    Ok(())
                } else {
                    inner.check(p, scratch)
                }
            }
            Form::Int { low, high } => {
                let value = p.int()?;
                if value < *low || value > *high {
                    return Err("an int out of range");
                }
                Ok(())
            }
            Form::Float => float(p),
            Form::Bool => p.bool().map(|_| ()),
            Form::Str => {
                scratch.clear();
                p.string_into(scratch)
            }
            Form::OneOf(words) => {
                scratch.clear();
                p.string_into(scratch)?;
                if words.iter().any(|w| w == scratch) {
                    Ok(())
                } else {
                    Err("not one of the literal's texts")
                }
            }
            Form::List(item) => {
                if p.open(b'[', b']')? {
                    loop {
                        // token ids and logprobs as orjson writes most, with their separator, in one step
                        match item.quick(p) {
                            Some(b']') => break,
                            Some(_) => continue,
                            None => {}
                        }
                        item.check(p, scratch)?;
                        if !p.more(b']')? {
                            break;
                        }
                    }
                }
                Ok(())
            }
            Form::Map(value) => {
                if p.open(b'{', b'}')? {
                    let mut keys = HashSet::new();
                    loop {
                        if !keys.insert(p.key()?) {
                            return Err("a key repeated in an object");
                        }
                        value.check(p, scratch)?;
                        if !p.more(b'}')? {
                            break;
                        }
                    }
                }
                Ok(())
            }
            Form::Object(members) => object(p, members, scratch, &[], &mut []),
        }
    }
}

impl Form {
    /// A list item of an int or float form, checked with the separator after it (consumed) where it is
    /// a plain int of up to 7 digits or a plain float (`Parser::compact_int`, `compact_float`); None:
    /// anything else, nothing consumed.
    #[inline]
    fn quick(&self, p: &mut Parser<'_>) -> Option<u8> {
        let form = match self {
            Form::Nullable(inner) => inner,
            form => form,
        };
        match form {
            Form::Int { low, high } if *low <= 0 && *high >= 9_999_999 => p.compact_int().map(|(_, stop)| stop),
            Form::Float => match p.compact_float() {
                None => p.compact_int().map(|(_, stop)| stop),
                found => found.map(|(_, stop)| stop),
            },
            _ => None,
        }
    }
}

/// A number where a float is due: pydantic takes an int there too; NaN and infinities do not fit.
fn float(p: &mut Parser<'_>) -> Res<()> {
    let text = p.number()?;
    let negative = usize::from(text[0] == b'-');
    let point = text.iter().position(|&c| c == b'.');
    if text.iter().any(|&c| c == b'e' || c == b'E') {
        // SAFETY: the number grammar lets through ASCII only
        let value: f64 = unsafe { std::str::from_utf8_unchecked(text) }
            .parse()
            .map_err(|_| "expected a number")?;
        if !value.is_finite() {
            return Err("a float beyond 64 bits");
        }
    } else if let Some(at) = point {
        if at - negative > 300 {
            return Err("a float beyond 64 bits"); // (below 10^300 without an exponent: finite)
        }
    } else if text.len() - negative > 18 {
        return Err("an int of more than 18 digits where a float is due");
    }
    Ok(())
}

/// An object of these members; the text of those with a slot in `slots` (by member) into `out`.
fn object(
    p: &mut Parser<'_>,
    members: &[Member],
    scratch: &mut Vec<u8>,
    slots: &[Option<usize>],
    out: &mut [Option<String>],
) -> Res<()> {
    let mut seen: u64 = 0;
    if p.open(b'{', b'}')? {
        // one writer writes the keys in one order: the key after the last one found is tried first
        let mut next = 0;
        loop {
            let key = p.key()?;
            let at = match members.get(next) {
                Some(m) if *m.key == *key => next,
                _ => members
                    .iter()
                    .position(|m| *m.key == *key)
                    .ok_or("a key the model does not have")?,
            };
            if seen & (1 << at) != 0 {
                return Err("a key repeated in an object");
            }
            seen |= 1 << at;
            next = at + 1;
            match slots.get(at).copied().flatten() {
                Some(slot) => out[slot] = text(p, &members[at].form, scratch)?,
                None => members[at].form.check(p, scratch)?,
            }
            if !p.more(b'}')? {
                break;
            }
        }
    }
    let missing = members
        .iter()
        .enumerate()
        .any(|(i, m)| m.required && seen & (1 << i) == 0);
    if missing {
        return Err("a required key missing");
    }
    Ok(())
}

/// A text (or null, where the form lets it be) checked as `form.check` does, and taken.
fn text(p: &mut Parser<'_>, form: &Form, scratch: &mut Vec<u8>) -> Res<Option<String>> {
    if matches!(form, Form::Nullable(_)) && p.null()? {
        return Ok(None);
    }
    scratch.clear();
    p.string_into(scratch)?;
    String::from_utf8(scratch.clone()).map(Some).map_err(|_| "not UTF-8")
}

/// What a check returns: the indices of the records that do not fit, and per key taken, its text in
/// each record (None where the record does not fit).
type Checked = (Vec<usize>, Vec<Vec<Option<String>>>);

/// A model's shape, to check records against (see the module's docs).
#[pyclass(frozen)]
pub struct Shape {
    root: Vec<Member>,
    /// per member of the root, the slot of the text taken from it
    slots: Vec<Option<usize>>,
    taken: usize,
}

impl Shape {
    fn fits(&self, value: &[u8], scratch: &mut Vec<u8>, out: &mut [Option<String>]) -> bool {
        let mut p = Parser { b: value, i: 0 };
        if object(&mut p, &self.root, scratch, &self.slots, out).is_err() {
            return false;
        }
        p.ws();
        p.i == value.len()
    }

    fn sort(&self, values: &[Option<&[u8]>]) -> Checked {
        let mut scratch = Vec::new();
        let mut misfits = vec![];
        let mut out = vec![None; self.taken];
        let mut columns = vec![Vec::with_capacity(values.len()); self.taken];
        for (i, value) in values.iter().enumerate() {
            out.iter_mut().for_each(|o| *o = None);
            if !value.is_some_and(|v| self.fits(v, &mut scratch, &mut out)) {
                misfits.push(i);
                out.iter_mut().for_each(|o| *o = None);
            }
            for (column, o) in columns.iter_mut().zip(out.iter_mut()) {
                column.push(o.take());
            }
        }
        (misfits, columns)
    }

    fn slices<'a>(values: &'a [Option<Bound<'_, PyBytes>>]) -> Vec<Option<&'a [u8]>> {
        values.iter().map(|v| v.as_ref().map(|b| b.as_bytes())).collect()
    }
}

#[pymethods]
impl Shape {
    /// `take`: keys of the root whose text (a str, or an optional one) each check also returns.
    #[new]
    #[pyo3(signature = (form, take = vec![]))]
    fn new(form: &Bound<'_, PyAny>, take: Vec<String>) -> PyResult<Self> {
        let Form::Object(root) = Form::from_py(form)? else {
            return Err(PyValueError::new_err("a record's shape is an object"));
        };
        let mut slots = vec![None; root.len()];
        for (slot, key) in take.iter().enumerate() {
            let at = root
                .iter()
                .position(|m| m.key == key.as_bytes())
                .ok_or_else(|| PyValueError::new_err(format!("no key {key:?} to take")))?;
            if !matches!(&root[at].form, Form::Str)
                && !matches!(&root[at].form, Form::Nullable(inner) if matches!(**inner, Form::Str))
            {
                return Err(PyValueError::new_err(format!("{key:?} is not a text")));
            }
            slots[at] = Some(slot);
        }
        Ok(Shape {
            root,
            slots,
            taken: take.len(),
        })
    }

    /// The indices of the values (bytes, or None) that do not fit.
    fn misfits(&self, py: Python<'_>, values: &Bound<'_, PyList>) -> PyResult<Vec<usize>> {
        Ok(self.check(py, values)?.0)
    }

    /// Like `misfits`, for what `take` kept of one fetch.
    fn misfits_fetched(&self, py: Python<'_>, fetched: &Fetched) -> Vec<usize> {
        self.check_fetched(py, fetched).0
    }

    /// The indices of the values that do not fit, and the texts taken (a list per key).
    fn check(&self, py: Python<'_>, values: &Bound<'_, PyList>) -> PyResult<Checked> {
        let held = values
            .iter()
            .map(|v| {
                if v.is_none() {
                    Ok(None)
                } else {
                    Ok(Some(v.cast_into::<PyBytes>()?))
                }
            })
            .collect::<PyResult<Vec<_>>>()?;
        let slices = Shape::slices(&held);
        Ok(py.detach(|| self.sort(&slices)))
    }

    /// Like `check`, for what `take` kept of one fetch.
    fn check_fetched(&self, py: Python<'_>, fetched: &Fetched) -> Checked {
        let slices: Vec<Option<&[u8]>> = fetched
            .values
            .iter()
            .map(|v| v.as_ref().map(|b| b.as_bytes(py)))
            .collect();
        py.detach(|| self.sort(&slices))
    }
}
