//! From a submission or a block list to lists of copies: requests
//! resolved once per run that shares a key and a local registration,
//! checked, grouped per GPU, and queued with the peer's mappings held open.

use crate::copies::InFlight;
use crate::import::{Import, View};
use crate::wire::Key;
use crate::{CudaIpcInstance, CudaIpcPeer, LocalMemory, LocalReg};
use ferry_cuda_driver::kernel::{Desc, LayoutCopy};
use ferry_plugins_abi::sdk::{
    block_extent, BlockList, LayoutList, Op, PluginError, PluginResult, TransferRequest,
};
use ferry_plugins_abi::ErrorCode;
use std::sync::Arc;

thread_local! {
    /// A block list's descriptors, kept for the thread's next list: 65,536
    /// blocks are 1.5 MiB, which the allocator would map, fault in and
    /// unmap on every list.
    static SPARE: std::cell::Cell<Vec<Desc>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Most descriptors a kept list holds (24 MiB).
const SPARE_MAX: usize = 1 << 20;

impl CudaIpcInstance {
    /// What a run of requests with one key and one local registration
    /// needs before their copies are queued: decoded, looked up, checked as
    /// a pair, the peer's registration opened.
    fn resolve(&self, peer: &CudaIpcPeer, key: &[u8], local_mem: u64) -> PluginResult<Resolved> {
        let key = Key::decode(key)
            .ok_or_else(|| PluginError::new(ErrorCode::Protocol, "malformed cuda-ipc key"))?;
        let local = self.local(local_mem).ok_or_else(|| {
            PluginError::new(
                ErrorCode::InvalidArgument,
                "cuda-ipc: the local buffer is not registered with cuda-ipc",
            )
        })?;
        let gpu = self
            .pair_verdict(local.memory, &key)
            .map_err(|why| PluginError::new(ErrorCode::Unavailable, format!("cuda-ipc: {why}")))?;
        let import = peer.import(self, &key, gpu)?;
        let device_only = matches!(local.memory, LocalMemory::Device(_)) && import.is_device();
        Ok(Resolved {
            local,
            gpu,
            import,
            device_only,
        })
    }

    /// Queues a submission's requests: one list per GPU (and kind of
    /// pair), one event behind each; a request that fails its checks is
    /// completed with its error alone.
    pub(crate) fn queue(
        &self,
        peer: &CudaIpcPeer,
        requests: &[TransferRequest<'_>],
    ) -> Vec<InFlight> {
        // Runs of requests with the same key and local registration (a
        // Mooncake batch is usually one run) are resolved once.
        let mut groups: Vec<Resolved> = Vec::new();
        let mut last: Option<(&[u8], u64, Result<usize, PluginError>)> = None;
        let mut checked: Vec<(&TransferRequest<'_>, usize)> = Vec::with_capacity(requests.len());
        for r in requests {
            let group = match &last {
                Some((key, mem, g)) if *key == r.remote_key && *mem == r.local_mem => g.clone(),
                _ => {
                    let g = self.resolve(peer, r.remote_key, r.local_mem).map(|x| {
                        groups.push(x);
                        groups.len() - 1
                    });
                    last = Some((r.remote_key, r.local_mem, g.clone()));
                    g
                }
            };
            match group
                .and_then(|g| check_local(&groups[g].local, r.local_addr, r.length).map(|()| g))
            {
                Ok(g) => checked.push((r, g)),
                Err(e) => self.completer.complete(r.token, Err(&e)),
            }
        }
        // One list per (GPU, both ends GPU memory): its imports, and each
        // group's place in it.
        let mut lists: Vec<List> = Vec::new();
        let mut place: Vec<Option<(usize, usize)>> = vec![None; groups.len()];
        for &(r, g) in &checked {
            let at = match place[g] {
                Some(at) => at,
                None => {
                    let res = &groups[g];
                    let l = match lists
                        .iter()
                        .position(|l| l.gpu == res.gpu && l.device_only == res.device_only)
                    {
                        Some(l) => l,
                        None => {
                            lists.push(List {
                                gpu: res.gpu,
                                device_only: res.device_only,
                                imports: Vec::new(),
                                requests: Vec::new(),
                            });
                            lists.len() - 1
                        }
                    };
                    let imports = &mut lists[l].imports;
                    let i = match imports.iter().position(|i| Arc::ptr_eq(i, &res.import)) {
                        Some(i) => i,
                        None => {
                            imports.push(res.import.clone());
                            imports.len() - 1
                        }
                    };
                    place[g] = Some((l, i));
                    (l, i)
                }
            };
            lists[at.0].requests.push((r, at.1));
        }
        lists
            .into_iter()
            .filter_map(|l| self.queue_list(l))
            .collect()
    }

    /// Queues a block list as one list, or refuses it whole before
    /// anything moves.
    pub(crate) fn queue_blocks(
        &self,
        peer: &CudaIpcPeer,
        list: &BlockList<'_>,
    ) -> PluginResult<()> {
        // Every block is checked before anything moves: one extent, then
        // one check against each side's registration.
        let (local_end, remote_end) = block_extent(list.blocks)?;
        let res = self.resolve(peer, list.remote_key, list.local_mem)?;
        check_local(&res.local, list.local_addr, local_end)?;
        let view = res.import.view()?;
        let remote = view.local(list.remote_addr, remote_end)?;
        let mut copies = SPARE.with(|s| s.take());
        copies.clear();
        copies.extend(list.blocks.iter().map(|b| {
            desc(
                list.op,
                list.local_addr + b.local_offset,
                remote + b.remote_offset,
                b.length,
            )
        }));
        // SAFETY: every local range lies in [local_addr, local_end), which
        // check_local placed in the live registration, and every remote one
        // in `remote`, which View::local placed in the open mapping; `view`
        // is held until after this call.
        let queued = unsafe { self.gpus.copy_list(res.gpu, &copies, res.device_only) };
        // The descriptors are in the launch's ring (or queued) now: keep
        // their memory for this thread's next list.
        if copies.capacity() <= SPARE_MAX {
            SPARE.with(|s| s.set(copies));
        }
        let event = queued?;
        drop(view);
        self.copies.add(vec![InFlight {
            event,
            tokens: vec![list.token],
            imports: vec![res.import],
        }]);
        Ok(())
    }

    /// Queues blocks by layout and index as one launch (or one list), or
    /// refuses them whole before anything moves: each layout's extent
    /// checked once against its side, each index array by its largest
    /// index; no per-block work on the host.
    pub(crate) fn queue_layouts(
        &self,
        peer: &CudaIpcPeer,
        list: &LayoutList<'_>,
    ) -> PluginResult<()> {
        list.check_indices()?;
        let too_far = |side: &str| {
            PluginError::new(
                ErrorCode::InvalidArgument,
                format!("cuda-ipc: the {side} layout runs past the end of the address space"),
            )
        };
        let local_end = list
            .local
            .extent(list.block_size)
            .ok_or_else(|| too_far("local"))?;
        let remote_end = list
            .remote
            .extent(list.block_size)
            .ok_or_else(|| too_far("remote"))?;
        let res = self.resolve(peer, list.remote_key, list.local_mem)?;
        check_local(&res.local, list.local.base, local_end)?;
        let view = res.import.view()?;
        let remote = view.local(list.remote.base, remote_end)?;
        let (local, remote) = (
            (list.local.base, list.local.stride, list.local_ids),
            (remote, list.remote.stride, list.remote_ids),
        );
        let (src, dst) = match list.op {
            Op::Write => (local, remote),
            Op::Read => (remote, local),
        };
        let copy = LayoutCopy {
            src_base: src.0,
            src_stride: src.1,
            dst_base: dst.0,
            dst_stride: dst.1,
            block: list.block_size,
            src_ids: src.2,
            dst_ids: dst.2,
        };
        // SAFETY: check_indices bounded every index, check_local placed the
        // local extent in the live registration and View::local the remote
        // one in the open mapping; `view` is dropped only after this call.
        let event = unsafe { self.gpus.copy_layouts(res.gpu, &copy, res.device_only) }?;
        drop(view);
        self.copies.add(vec![InFlight {
            event,
            tokens: vec![list.token],
            imports: vec![res.import],
        }]);
        Ok(())
    }

    /// Queues one GPU's list with the peer's mappings held open, or
    /// completes its requests with the error.
    fn queue_list(&self, list: List<'_, '_>) -> Option<InFlight> {
        let views: Vec<PluginResult<View<'_>>> = list.imports.iter().map(|i| i.view()).collect();
        let mut copies = Vec::with_capacity(list.requests.len());
        let mut tokens = Vec::with_capacity(list.requests.len());
        for &(r, i) in &list.requests {
            let remote = match &views[i] {
                Ok(v) => v.local(r.remote_addr, r.length),
                Err(e) => Err(e.clone()),
            };
            match remote {
                Ok(remote) => {
                    copies.push(desc(r.op, r.local_addr, remote, r.length));
                    tokens.push(r.token);
                }
                Err(e) => self.completer.complete(r.token, Err(&e)),
            }
        }
        if copies.is_empty() {
            return None;
        }
        // SAFETY: each copy's local range passed check_local against its
        // group's live registration when the lists were built, and its remote
        // range View::local against the open mapping of `views`, held until
        // after this call.
        match unsafe { self.gpus.copy_list(list.gpu, &copies, list.device_only) } {
            Ok(event) => Some(InFlight {
                event,
                tokens,
                imports: list.imports.clone(),
            }),
            Err(e) => {
                for t in tokens {
                    self.completer.complete(t, Err(&e));
                }
                None
            }
        }
    }
}

/// A request's pair, resolved (see `CudaIpcInstance::resolve`).
struct Resolved {
    local: LocalReg,
    gpu: usize,
    import: Arc<Import>,
    device_only: bool,
}

/// The requests of one submission that one GPU moves as one list, each
/// with the index of its peer registration in `imports`.
struct List<'s, 'r> {
    gpu: usize,
    device_only: bool,
    imports: Vec<Arc<Import>>,
    requests: Vec<(&'s TransferRequest<'r>, usize)>,
}

/// `[addr, + len)` must lie inside the local registration.
fn check_local(local: &LocalReg, addr: u64, len: u64) -> PluginResult<()> {
    let inside = addr >= local.addr
        && addr
            .checked_add(len)
            .is_some_and(|e| e <= local.addr + local.len);
    if inside {
        return Ok(());
    }
    Err(PluginError::new(
        ErrorCode::OutOfBounds,
        format!("cuda-ipc: local [{addr:#x}, +{len}) is outside its registration"),
    ))
}

/// The copy that moves `len` bytes between a local and a (mapped) remote
/// address in the direction of `op`.
fn desc(op: Op, local: u64, remote: u64, len: u64) -> Desc {
    match op {
        Op::Write => Desc {
            src: local,
            dst: remote,
            len,
        },
        Op::Read => Desc {
            src: remote,
            dst: local,
            len,
        },
    }
}
