//! Where a get puts the values it reads: one trait, [`Sink`], asked for a
//! buffer per value (or for all of them at once, or to take memory the
//! transport lends it). What a value is asked by differs with the API:
//! the blob API asks by [`ValueAsk`] (the key's index, the value's length
//! and metadata), the rows × fields API by [`TensorAsk`] (field, row,
//! dtype, shape). [`GetSink`] and [`TensorSink`] name the two.
//!
//! A get reads every unit's values at once, on the calling thread: each
//! unit's part asks the sink for the buffers of its own unit's values.

use std::ops::Range;
use std::sync::Arc;

use crate::values::DType;
use crate::Lent;

/// A value of the blob API, as its get asks for a buffer.
#[derive(Clone, Copy, Debug)]
pub struct ValueAsk<'a> {
    /// The key's position in the call's key list.
    pub index: usize,
    /// The value's length in bytes: the buffer's.
    pub len: u64,
    /// The metadata stored with the value.
    pub meta: &'a [u8],
}

/// A value of the rows × fields API, as its get asks for a buffer.
#[derive(Clone, Copy, Debug)]
pub struct TensorAsk<'a> {
    /// The position in the call's field list.
    pub field: usize,
    /// The position in the call's key (row) list.
    pub row: usize,
    pub dtype: DType,
    pub shape: &'a [u64],
}

/// Where a get puts each value: asked once per found value (`A`: what
/// the get knows of it), it returns the buffer of exactly the value's
/// bytes to fill.
pub trait Sink<A> {
    /// The buffer of one value.
    fn slot(&mut self, ask: A) -> Result<&mut [u8], String>;

    /// The buffers of many values at once, in the order of `asks` (each
    /// value at most once), so that a transport can fill them together on
    /// several threads. `None` (the default): the sink hands out one
    /// buffer at a time through [`Sink::slot`].
    fn slots(&mut self, asks: &[A]) -> Option<Result<Vec<&mut [u8]>, String>> {
        let _ = asks;
        None
    }

    /// Zero-copy gets: whether the sink takes the values of `asks` (as for
    /// [`Sink::slots`], checked as it would check them) in memory the
    /// transport lends it, filled by the transfer itself (a nixl READ into
    /// the client's registered receive pool). `Some(Ok(()))`: yes, and the
    /// transport then hands them over with [`Sink::lent`]; `Some(Err)`:
    /// refused, as `slots` refuses; `None` (the default): the sink wants
    /// the values in buffers of its own.
    fn accept_lent(&mut self, asks: &[A]) -> Option<Result<(), String>> {
        let _ = asks;
        None
    }

    /// The values `accept_lent` took, in the order of `asks`: value `i`
    /// is `buf[spans[i]]` (64-byte aligned). The sink owns `buf` from now
    /// on; nothing else reads or writes it.
    fn lent(&mut self, asks: &[A], buf: Lent, spans: &[Range<usize>]) -> Result<(), String> {
        let _ = (asks, buf, spans);
        Err("this sink takes no lent memory".into())
    }
}

/// A sink of the blob API ([`crate::Client::get_into`]): implement
/// [`Sink<ValueAsk>`] to be one.
pub trait GetSink: for<'a> Sink<ValueAsk<'a>> {}

impl<T: ?Sized + for<'a> Sink<ValueAsk<'a>>> GetSink for T {}

/// A sink of the rows × fields API ([`crate::Client::get_tensors_into`]):
/// implement [`Sink<TensorAsk>`] to be one.
pub trait TensorSink: for<'a> Sink<TensorAsk<'a>> {}

impl<T: ?Sized + for<'a> Sink<TensorAsk<'a>>> TensorSink for T {}

/// A sink that counts the bytes it is handed (for metrics).
pub(crate) struct Counting<'a> {
    pub(crate) inner: &'a mut dyn GetSink,
    pub(crate) bytes: u64,
}

impl Sink<ValueAsk<'_>> for Counting<'_> {
    fn slot(&mut self, ask: ValueAsk<'_>) -> std::result::Result<&mut [u8], String> {
        self.bytes += ask.len;
        self.inner.slot(ask)
    }

    fn slots(
        &mut self,
        asks: &[ValueAsk<'_>],
    ) -> Option<std::result::Result<Vec<&mut [u8]>, String>> {
        let r = self.inner.slots(asks);
        if matches!(r, Some(Ok(_))) {
            self.bytes += asks.iter().map(|a| a.len).sum::<u64>();
        }
        r
    }

    fn accept_lent(&mut self, asks: &[ValueAsk<'_>]) -> Option<std::result::Result<(), String>> {
        self.inner.accept_lent(asks)
    }

    fn lent(
        &mut self,
        asks: &[ValueAsk<'_>],
        buf: Lent,
        spans: &[std::ops::Range<usize>],
    ) -> std::result::Result<(), String> {
        self.inner.lent(asks, buf, spans)?;
        self.bytes += asks.iter().map(|a| a.len).sum::<u64>();
        Ok(())
    }
}

/// A value a get returned ([`Client::get_values`](crate::Client::get_values)): a vector of its own,
/// or its span of memory the transport lent the call (zero-copy over
/// nixl; the values one unit sent share it, and it goes back to the
/// client's receive pool when the last of them is dropped).
#[derive(Debug)]
pub enum Value {
    Owned(Vec<u8>),
    Lent(Arc<Lent>, std::ops::Range<usize>),
}

impl std::ops::Deref for Value {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Value::Owned(v) => v,
            Value::Lent(buf, span) => &buf[span.clone()],
        }
    }
}

/// A new zeroed vector of `len` bytes for a value a sink collects.
fn zeroed(len: u64) -> std::result::Result<Vec<u8>, String> {
    let len = usize::try_from(len).map_err(|_| "value larger than memory".to_string())?;
    Ok(vec![0u8; len])
}

/// A sink that collects values into [`Value`]s, taking lent memory.
pub(crate) struct ValueSink(pub(crate) Vec<Option<Value>>);

impl Sink<ValueAsk<'_>> for ValueSink {
    fn slot(&mut self, ask: ValueAsk<'_>) -> std::result::Result<&mut [u8], String> {
        let fresh = zeroed(ask.len)?;
        let v = self.0.get_mut(ask.index).ok_or("key index out of range")?;
        match v.insert(Value::Owned(fresh)) {
            Value::Owned(v) => Ok(v.as_mut_slice()),
            Value::Lent(..) => Err("a lent value".into()),
        }
    }

    fn accept_lent(&mut self, asks: &[ValueAsk<'_>]) -> Option<std::result::Result<(), String>> {
        let n = self.0.len();
        Some(match asks.iter().find(|a| a.index >= n) {
            Some(_) => Err("key index out of range".into()),
            None => Ok(()),
        })
    }

    fn lent(
        &mut self,
        asks: &[ValueAsk<'_>],
        buf: Lent,
        spans: &[std::ops::Range<usize>],
    ) -> std::result::Result<(), String> {
        let buf = Arc::new(buf);
        for (a, span) in asks.iter().zip(spans) {
            let v = self.0.get_mut(a.index).ok_or("key index out of range")?;
            *v = Some(Value::Lent(buf.clone(), span.clone()));
        }
        Ok(())
    }
}

/// A sink that collects values into fresh vectors.
pub(crate) struct VecSink(pub(crate) Vec<Option<Vec<u8>>>);

impl Sink<ValueAsk<'_>> for VecSink {
    fn slot(&mut self, ask: ValueAsk<'_>) -> std::result::Result<&mut [u8], String> {
        let fresh = zeroed(ask.len)?;
        let v = self.0.get_mut(ask.index).ok_or("key index out of range")?;
        Ok(v.insert(fresh).as_mut_slice())
    }
}

/// A sink over caller buffers: value `i` goes to the front of `bufs[i]`,
/// its length to `lens[i]`.
pub struct SliceSink<'a, 'b> {
    pub bufs: &'a mut [&'b mut [u8]],
    pub lens: Vec<u64>,
}

impl<'a, 'b> SliceSink<'a, 'b> {
    pub fn new(bufs: &'a mut [&'b mut [u8]]) -> Self {
        let n = bufs.len();
        Self {
            bufs,
            lens: vec![0; n],
        }
    }
}

impl Sink<ValueAsk<'_>> for SliceSink<'_, '_> {
    fn slot(&mut self, ask: ValueAsk<'_>) -> std::result::Result<&mut [u8], String> {
        let ValueAsk { index, len, .. } = ask;
        let buf = self.bufs.get_mut(index).ok_or("key index out of range")?;
        let n = usize::try_from(len).map_err(|_| "value larger than memory".to_string())?;
        if n > buf.len() {
            return Err(format!(
                "value {index} is {len} bytes, its buffer only {}",
                buf.len()
            ));
        }
        self.lens[index] = len;
        Ok(&mut buf[..n])
    }
}
