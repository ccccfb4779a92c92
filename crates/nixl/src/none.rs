//! Built without the `nixl` feature: the same types, none of which can be
//! made (every constructor answers [`NixlError::NotBuilt`]).

use std::sync::Arc;

use stowage_shm::Slab;

use crate::{NixlError, Op, Range, WaitError};

#[derive(Clone, Copy, Debug)]
enum Never {}

#[derive(Clone, Debug)]
pub struct Agent(Never);

impl Agent {
    pub fn new(_name: &str, _progress: Option<std::time::Duration>) -> Result<Self, NixlError> {
        Err(NixlError::NotBuilt)
    }

    pub fn name(&self) -> &str {
        match self.0 {}
    }

    pub fn metadata(&self) -> Result<Vec<u8>, NixlError> {
        match self.0 {}
    }

    pub fn load_remote(&self, _metadata: &[u8]) -> Result<String, NixlError> {
        match self.0 {}
    }

    pub fn forget_remote(&self, _name: &str) {
        match self.0 {}
    }

    pub fn invalidate_remote(&self, _name: &str) -> Result<(), NixlError> {
        match self.0 {}
    }

    pub fn connection_metadata(&self) -> Result<Vec<u8>, NixlError> {
        match self.0 {}
    }

    pub fn register_slab(&self, _slab: Arc<Slab>) -> Result<SlabRegistration, NixlError> {
        match self.0 {}
    }

    pub fn post(
        &self,
        _op: Op,
        _staging: &Arc<Staging>,
        _ranges: &[Range],
        _peer: &str,
    ) -> Result<Transfer, NixlError> {
        match self.0 {}
    }

    pub fn post_write(
        &self,
        _staging: Option<&Arc<Staging>>,
        _staged: &[Range],
        _direct: &[(&Registered<'_>, u64)],
        _peer: &str,
    ) -> Result<Transfer, NixlError> {
        match self.0 {}
    }

    pub fn register<'a>(&self, _buf: &'a [u8]) -> Result<Registered<'a>, NixlError> {
        match self.0 {}
    }
}

pub struct Registered<'a>(Never, std::marker::PhantomData<&'a [u8]>);

pub struct SlabRegistration(Never);

#[derive(Debug)]
pub struct Staging(Never);

impl Staging {
    pub fn new(agent: &Agent, _len: usize) -> Result<Self, NixlError> {
        match agent.0 {}
    }

    pub fn len(&self) -> usize {
        match self.0 {}
    }

    pub fn is_empty(&self) -> bool {
        match self.0 {}
    }

    pub fn as_slice(&self) -> &[u8] {
        match self.0 {}
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        match self.0 {}
    }
}

pub struct Transfer(Never);

impl Transfer {
    pub fn poll(&mut self) -> Result<bool, NixlError> {
        match self.0 {}
    }

    pub fn ended(&self) -> bool {
        match self.0 {}
    }

    pub fn wait(&mut self, _deadline: std::time::Instant) -> Result<(), WaitError> {
        match self.0 {}
    }
}
