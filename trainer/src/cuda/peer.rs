//! Recovery from survivors' GPU memory over NCCL, instead of the store.
//!
//! After a failure, the ranks of the new layout need boxes of every tensor. Where a
//! survivor still holds a needed region **in device memory, with the contents of the step
//! being restored**, it can send it over NCCL (NVLink or InfiniBand, tens of GB/s per rank)
//! instead of the receiver fetching, hash-checking and decompressing it from the store.
//!
//! - [`plan`] (pure, in [`crate::peer_plan`] and re-exported here) matches each needed box
//!   against the holdings, cutting it into regions sent by survivors and regions left to
//!   the store, and estimates both ways with [`PeerCost`].
//! - [`PeerExchange`] executes a plan on one rank: pack each region into a contiguous device
//!   buffer, `ncclSend`/`ncclRecv` in one NCCL group per round of bounded memory, unpack
//!   into the destination; [`store_targets`] gives the restore targets for the rest, and
//!   [`restore_with_peers`] does both.
//!
//! **When it is chosen.** The peer path is used only when all of these hold, otherwise
//! everything comes from the store:
//!
//! 1. the survivors kept their processes and device memory (an in-process re-layout, not a
//!    relaunch, which loses device memory), and every rank of the new layout joins one
//!    NCCL communicator ([`PeerExchange::new`]; the unique id travels out of band, e.g.
//!    through the supervisor);
//! 2. the holdings are of exactly the step being restored ([`Holding::step`]): survivors
//!    whose tensors moved past the checkpoint (an optimizer step after it) are ignored, as
//!    mixing steps would break bit-identical resumption;
//! 3. the estimate says it is faster: `setup_s + busiest rank's sent or received bytes /
//!    link_bytes_per_s` is below `the busiest receiver's bytes / store_bytes_per_s`
//!    (measured figures should replace [`PeerCost::default`]).
//!
//! Destinations must be buffers separate from the sources (sources are freed afterwards).

use std::ffi::c_void;
use std::sync::Arc;
use std::time::Instant;

use ckpt_store::{DType, Error, ErrorKind, NdBox, ReadStats, Result, StepReader};
use cudarc::nccl::{result as nccl, sys as nsys};

use super::copy::{Dense, enqueue, plan_window};
use super::{DeviceRegion, DeviceTensor, Gpu, cu, nccl_present};
pub use crate::peer_plan::{
    Holding, Need, PeerCost, PeerPlan, StoreRead, Transfer, plan, rounds, subtract,
};
use crate::restore::{RestoreTarget, restore_targets};

/// A tensor's memory on this rank, as a source (what a survivor holds now) or a
/// destination (what this rank holds under the new layout).
#[derive(Debug, Clone)]
pub struct PeerTensor {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Global shape.
    pub shape: Vec<u64>,
    /// The box the memory holds, row-major.
    pub held: NdBox,
    /// The memory.
    pub memory: DeviceTensor,
}

fn find<'a>(
    ts: &'a [PeerTensor],
    name: &str,
    region: &NdBox,
    what: &str,
) -> Result<&'a PeerTensor> {
    let t = ts
        .iter()
        .find(|t| t.name == name && t.held.contains(region))
        .ok_or_else(|| {
            Error::invalid(format!(
                "no {what} tensor {name:?} on this rank holds the region {region}"
            ))
        })?;
    let want = t.held.numel() as usize * t.dtype.size();
    if t.memory.len() != want {
        return Err(Error::invalid(format!(
            "{what} tensor {name:?}: held box {} needs {want} bytes, its memory has {}",
            t.held,
            t.memory.len()
        )));
    }
    Ok(t)
}

/// What one rank moved.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PeerStats {
    /// Bytes sent to other ranks.
    pub bytes_sent: u64,
    /// Bytes received from other ranks.
    pub bytes_received: u64,
    /// Bytes copied within this rank.
    pub bytes_local: u64,
    /// Seconds.
    pub seconds: f64,
}

fn nc<T>(what: &str, f: impl FnOnce() -> std::result::Result<T, nccl::NcclError>) -> Result<T> {
    if !nccl_present() {
        return Err(Error::new(
            ErrorKind::NoDevice,
            format!(
                "NCCL: {what}: libnccl.so could not be loaded (install NCCL, or link \
                 libnccl.so.2 as libnccl.so on the library path)"
            ),
        ));
    }
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(Error::new(
            ErrorKind::Device,
            format!("NCCL: {what}: {:?}", e.0),
        )),
        Err(p) => Err(Error::new(
            ErrorKind::NoDevice,
            format!("NCCL: {what}: {}", super::panic_text(&*p)),
        )),
    }
}

/// One rank's end of an NCCL communicator over the ranks of the new layout.
pub struct PeerExchange {
    gpu: Arc<Gpu>,
    comm: Option<nsys::ncclComm_t>,
    stream: Arc<cudarc::driver::CudaStream>,
    rank: u32,
    world: u32,
    /// Bytes of temporary device buffers per rank and round (default 1 GiB).
    pub round_bytes: u64,
    /// Send regions a rank copies to itself through NCCL too (default off: a device copy).
    pub local_via_nccl: bool,
}

// SAFETY: the communicator is used by one thread at a time (&mut-free API, but PeerExchange
// is not Sync).
unsafe impl Send for PeerExchange {}

impl std::fmt::Debug for PeerExchange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PeerExchange(rank {} of {}, {:?})",
            self.rank, self.world, self.gpu
        )
    }
}

impl PeerExchange {
    /// A new communicator id: made on one rank, given to every other out of band.
    pub fn unique_id() -> Result<[u8; 128]> {
        let id = nc("making a unique id", nccl::get_uniqueid)?;
        Ok(id.internal.map(|c| c as u8))
    }

    /// Join the communicator `id` as `rank` of `world` (every rank calls this; it returns
    /// when all have joined).
    pub fn new(gpu: &Arc<Gpu>, rank: u32, world: u32, id: &[u8; 128]) -> Result<Self> {
        if rank >= world {
            return Err(Error::invalid(format!(
                "rank {rank} is not below world size {world}"
            )));
        }
        let stream = cu("creating the exchange stream", || gpu.ctx.new_stream())?;
        cu("binding the context", || gpu.ctx.bind_to_thread())?;
        let id = nsys::ncclUniqueId {
            internal: id.map(|b| b as std::ffi::c_char),
        };
        let mut comm: nsys::ncclComm_t = std::ptr::null_mut();
        nc("joining the communicator", || {
            // SAFETY: comm is written by NCCL on success.
            unsafe { nccl::comm_init_rank(&mut comm, world as i32, id, rank as i32) }
        })?;
        Ok(PeerExchange {
            gpu: gpu.clone(),
            comm: Some(comm),
            stream,
            rank,
            world,
            round_bytes: 1 << 30,
            local_via_nccl: false,
        })
    }

    /// Rank 0 of a world of one, without NCCL: executes plans whose transfers are all
    /// local (a re-layout within one process and GPU) with device copies.
    pub fn local(gpu: &Arc<Gpu>) -> Result<Self> {
        let stream = cu("creating the exchange stream", || gpu.ctx.new_stream())?;
        Ok(PeerExchange {
            gpu: gpu.clone(),
            comm: None,
            stream,
            rank: 0,
            world: 1,
            round_bytes: 1 << 30,
            local_via_nccl: false,
        })
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    fn buf(&self, len: u64) -> Result<DevBuf> {
        let ptr = cu("allocating an exchange buffer", || {
            self.gpu.ctx.bind_to_thread()?;
            // SAFETY: freed in DevBuf's drop.
            unsafe { cudarc::driver::result::malloc_sync((len as usize).max(1)) }
        })?;
        Ok(DevBuf {
            gpu: self.gpu.clone(),
            stream: self.stream.clone(),
            ptr,
        })
    }

    /// Run this rank's part of `plan`: send what it holds in `sources` to the ranks that
    /// need it and receive what it needs into `dests` (every rank calls this with the same
    /// plan). Returns when the bytes are in place.
    pub fn execute(
        &self,
        plan: &PeerPlan,
        sources: &[PeerTensor],
        dests: &[PeerTensor],
    ) -> Result<PeerStats> {
        let t0 = Instant::now();
        let mut stats = PeerStats::default();
        if !plan.use_peers {
            return Ok(stats);
        }
        let me = self.rank;
        let ctx = &self.gpu.ctx;
        let s = self.stream.cu_stream();
        // After the work queued on every involved tensor's compute stream.
        cu("ordering the exchange after the compute streams", || {
            for t in sources.iter().chain(dests) {
                self.stream.join(t.memory.stream())?;
            }
            Ok(())
        })?;
        for round in rounds(&plan.transfers, self.round_bytes) {
            let ts = &plan.transfers[round];
            // (transfer, source or destination tensor, temporary buffer)
            let mut packs: Vec<(&Transfer, &PeerTensor, DevBuf)> = Vec::new();
            let mut unpacks: Vec<(&Transfer, &PeerTensor, DevBuf)> = Vec::new();
            let mut locals: Vec<(&PeerTensor, &PeerTensor, &Transfer, DevBuf)> = Vec::new();
            for t in ts {
                if t.from != me && t.to != me {
                    continue;
                }
                if t.from == me && t.to == me && !self.local_via_nccl {
                    let src = find(sources, &t.tensor, &t.region, "source")?;
                    let dst = find(dests, &t.tensor, &t.region, "destination")?;
                    locals.push((src, dst, t, self.buf(t.bytes)?));
                    continue;
                }
                if t.from == me {
                    let src = find(sources, &t.tensor, &t.region, "source")?;
                    packs.push((t, src, self.buf(t.bytes)?));
                }
                if t.to == me {
                    let dst = find(dests, &t.tensor, &t.region, "destination")?;
                    unpacks.push((t, dst, self.buf(t.bytes)?));
                }
            }
            // Pack (and local copies).
            for (t, src, buf) in &packs {
                copy_region(ctx, src, &t.region, buf.ptr, true, s)?;
            }
            for (src, dst, t, buf) in &locals {
                copy_region(ctx, src, &t.region, buf.ptr, true, s)?;
                copy_region(ctx, dst, &t.region, buf.ptr, false, s)?;
                stats.bytes_local += t.bytes;
            }
            // Exchange, in plan order on both sides of every pair, in one group.
            if !packs.is_empty() || !unpacks.is_empty() {
                self.exchange(&packs, &unpacks, &mut stats)?;
            }
            for (t, dst, buf) in &unpacks {
                copy_region(ctx, dst, &t.region, buf.ptr, false, s)?;
            }
            cu("waiting for the exchange", || self.stream.synchronize())?;
        }
        stats.seconds = t0.elapsed().as_secs_f64();
        Ok(stats)
    }

    /// Send what `packs` hold and receive into `unpacks`' buffers, as one NCCL group.
    fn exchange(
        &self,
        packs: &[(&Transfer, &PeerTensor, DevBuf)],
        unpacks: &[(&Transfer, &PeerTensor, DevBuf)],
        stats: &mut PeerStats,
    ) -> Result<()> {
        let ctx = &self.gpu.ctx;
        let s = self.stream.cu_stream();
        let comm = self.comm.ok_or_else(|| {
            Error::invalid(
                "the plan sends between ranks but this exchange has no NCCL \
                 communicator (PeerExchange::local)",
            )
        })?;
        let sends = packs.iter().map(|(t, _, b)| (*t, b.ptr, true));
        let recvs = unpacks.iter().map(|(t, _, b)| (*t, b.ptr, false));
        // Within a group NCCL matches the sends from one rank to another with that
        // rank's receives in the order issued: both follow the plan's order.
        let ops: Vec<(&Transfer, u64, bool)> = sends.chain(recvs).collect();
        cu("binding the context", || ctx.bind_to_thread())?;
        nc("starting a group", nccl::group_start)?;
        let mut res = Ok(());
        for (t, ptr, is_send) in ops {
            let n = t.bytes as usize;
            let dt = nsys::ncclDataType_t::ncclUint8;
            let st = s as nsys::cudaStream_t;
            res = if is_send {
                stats.bytes_sent += t.bytes;
                // SAFETY: the buffer holds the packed region until the stream ran.
                nc("sending", || unsafe {
                    nccl::send(ptr as *const c_void, n, dt, t.to as i32, comm, st)
                })
            } else {
                stats.bytes_received += t.bytes;
                // SAFETY: the buffer has room for the region.
                nc("receiving", || unsafe {
                    nccl::recv(ptr as *mut c_void, n, dt, t.from as i32, comm, st)
                })
            }
            .map(|_| ());
            if res.is_err() {
                break;
            }
        }
        let end = nc("ending a group", nccl::group_end).map(|_| ());
        res.and(end)?;
        Ok(())
    }
}

/// Copy `region` between tensor `t` (strided) and the dense device buffer at `buf`.
fn copy_region(
    ctx: &Arc<cudarc::driver::CudaContext>,
    t: &PeerTensor,
    region: &NdBox,
    buf: u64,
    to_buf: bool,
    stream: cudarc::driver::sys::CUstream,
) -> Result<()> {
    let elem = t.dtype.size();
    let mut runs = Vec::new();
    ckpt_store::model::copy_runs(&t.held, region, region, elem, |a, b, l| {
        runs.push((a as usize, b as usize, l as usize))
    });
    let len = region.numel() as usize * elem;
    let ops = plan_window(&runs, 0, len);
    let dev = t.memory.device_ptr();
    cu("copying a region on the device", || {
        ctx.bind_to_thread()?;
        for op in &ops {
            // SAFETY: the runs lie in the tensor's held box and in the buffer of `len`
            // bytes, which lives until the stream is synchronized.
            unsafe { enqueue(op, dev, Dense::Device(buf), to_buf, stream)? };
        }
        Ok(())
    })
}

/// A temporary device buffer used on the exchange stream, freed on drop once that stream
/// has run everything queued (also on error paths).
struct DevBuf {
    gpu: Arc<Gpu>,
    stream: Arc<cudarc::driver::CudaStream>,
    ptr: u64,
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        let _ = cu("freeing an exchange buffer", || {
            self.gpu.ctx.bind_to_thread()?;
            self.stream.synchronize()?;
            // SAFETY: allocated by PeerExchange::buf; the stream that used it is idle.
            unsafe { cudarc::driver::result::free_sync(self.ptr) }
        });
    }
}

impl Drop for PeerExchange {
    fn drop(&mut self) {
        let Some(comm) = self.comm else { return };
        let _ = nc("destroying the communicator", || {
            // SAFETY: created in new, used by no one else.
            unsafe { nccl::comm_destroy(comm) }
        });
    }
}

/// The restore targets of `rank`'s store reads in `plan`, writing into `dests`.
pub fn store_targets(
    plan: &PeerPlan,
    rank: u32,
    dests: &[PeerTensor],
) -> Result<Vec<RestoreTarget>> {
    let mut out = Vec::new();
    for r in plan.store_reads.iter().filter(|r| r.rank == rank) {
        let d = find(dests, &r.tensor, &r.region, "destination")?;
        out.push(RestoreTarget {
            name: d.name.clone(),
            dtype: d.dtype,
            shape: d.shape.clone(),
            bbox: r.region.clone(),
            sink: Arc::new(DeviceRegion::new(
                d.memory.clone(),
                &d.held,
                &r.region,
                d.dtype.size(),
            )?),
        });
    }
    Ok(out)
}

/// What a restore with peers moved.
#[derive(Debug, Clone, Default)]
pub struct PeerRestoreStats {
    /// From peers.
    pub peers: PeerStats,
    /// From the store.
    pub store: ReadStats,
}

/// Restore `rank`'s `dests` for `plan`: the peer transfers first (when the plan takes the
/// peer path; then `exchange` is required), then the rest from the store through `reader`
/// with at most `budget` bytes in flight.
pub fn restore_with_peers(
    reader: &StepReader,
    exchange: Option<&PeerExchange>,
    plan: &PeerPlan,
    rank: u32,
    sources: &[PeerTensor],
    dests: &[PeerTensor],
    budget: usize,
) -> Result<PeerRestoreStats> {
    let peers = if plan.use_peers {
        let ex = exchange.ok_or_else(|| {
            Error::invalid("the plan takes the peer path but no NCCL communicator was given")
        })?;
        ex.execute(plan, sources, dests)?
    } else {
        PeerStats::default()
    };
    let targets = store_targets(plan, rank, dests)?;
    let store = crate::save::runtime().block_on(restore_targets(reader, &targets, budget))?;
    Ok(PeerRestoreStats { peers, store })
}
