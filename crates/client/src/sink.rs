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

use crate::rows::DType;
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
