//! What a rank checkpoints: the registered tensors (their specs, held boxes and memory,
//! [`TensorMemory`]) and [`Stateful`] items, and the two views of them the manager needs:
//! what a save writes under the current layout ([`Registry::save_state`]) and what a restore
//! fills ([`Registry::restore_targets`], [`Registry::load_stateful`]).

use std::collections::HashMap;
use std::sync::Arc;

use ckpt_store::placement::place_rank;
use ckpt_store::{Error, NdBox, Result, StepReader, TensorSpec};
use parking_lot::Mutex;
use tracing::warn;

use crate::memory::{HostTensor, HostView, MemorySink, MemorySource};
use crate::monitor::Monitor;
use crate::restore::RestoreTarget;
use crate::save::{CheckpointerConfig, SaveState, SaveTensor, runtime};

/// The blob (`rank/<name>`) that keeps the monitor's window and rollback history with each
/// checkpoint; reserved.
pub const MONITOR_BLOB: &str = "ckpt-monitor";

/// State that is not a tensor: RNG, data-loader position, LR schedule.
pub trait Stateful: Send {
    /// Serialize the state.
    fn state_dict(&self) -> Vec<u8>;
    /// Restore the state.
    fn load_state_dict(&mut self, bytes: &[u8]) -> Result<()>;
}

/// Who saves a [`Stateful`] item and where a restore reads it from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The same on every rank (data position, step): saved by rank 0, restored by all.
    Global,
    /// Each rank's own (a per-rank RNG): restored from the same rank when the layout is
    /// unchanged; left as it is (with a warning) when the job was resharded.
    PerRank,
}

/// Memory of a tensor a rank holds, from which the boxes placement assigns can be cut.
pub trait TensorMemory: Send + Sync {
    /// A source for the part `sub` of the held box `held`.
    fn source(&self, held: &NdBox, sub: &NdBox, elem: usize) -> Result<Arc<dyn MemorySource>>;
    /// A sink for the whole held box.
    fn sink(&self, held: &NdBox, elem: usize) -> Result<Arc<dyn MemorySink>>;
}

impl TensorMemory for HostTensor {
    fn source(&self, held: &NdBox, sub: &NdBox, elem: usize) -> Result<Arc<dyn MemorySource>> {
        if held == sub {
            return Ok(Arc::new(self.clone()));
        }
        Ok(Arc::new(HostView::new(
            self.clone(),
            held.clone(),
            sub.clone(),
            elem,
        )?))
    }
    fn sink(&self, held: &NdBox, elem: usize) -> Result<Arc<dyn MemorySink>> {
        let have = MemorySink::len(self);
        let want = held.numel() as usize * elem;
        if have != want {
            return Err(Error::invalid(format!(
                "held box {held} needs {want} bytes, the tensor has {have}"
            )));
        }
        Ok(Arc::new(self.clone()))
    }
}

struct Registered {
    spec: TensorSpec,
    held: NdBox,
    memory: Arc<dyn TensorMemory>,
    saves: Saves,
    /// Training changes it (the sentinel's stale-state check watches it).
    trainable: bool,
}

impl Registered {
    /// The held box as registered, written by this rank or by `replica_of`.
    fn held_box(&self, replica_of: Option<u32>) -> Result<SaveTensor> {
        let elem = self.spec.dtype.size();
        // A replica's memory too: the sentinel hashes it (never written).
        let source = Some(self.memory.source(&self.held, &self.held, elem)?);
        Ok(SaveTensor {
            name: self.spec.name.clone(),
            dtype: self.spec.dtype,
            shape: self.spec.shape.clone(),
            bbox: self.held.clone(),
            placement: None,
            source,
            replica_of,
        })
    }

    /// A box placement assigns to this rank, cut out of the held box.
    fn placed_box(&self, cfg: &CheckpointerConfig, p: &ckpt_store::Placed) -> Result<SaveTensor> {
        if !self.held.contains(&p.bbox) {
            return Err(Error::invalid(format!(
                "tensor {:?}: rank {} must save box {} under {} but holds only {}",
                self.spec.name, cfg.rank, p.bbox, cfg.layout, self.held
            )));
        }
        let elem = self.spec.dtype.size();
        // A replica's memory too: the sentinel hashes it (never written).
        let source = Some(self.memory.source(&self.held, &p.bbox, elem)?);
        Ok(SaveTensor {
            name: self.spec.name.clone(),
            dtype: self.spec.dtype,
            shape: self.spec.shape.clone(),
            bbox: p.bbox.clone(),
            placement: Some(self.spec.placement.clone()),
            source,
            replica_of: p.replica_of,
        })
    }
}

/// Which boxes of a registered tensor a save writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Saves {
    /// The boxes the placement rules assign to this rank under the layout.
    Placed,
    /// Exactly the held box: written by this rank (`None`) or by the given rank, of which this
    /// rank holds a replica ([`super::CheckpointManager::register_held`]).
    Held(Option<u32>),
}

type StatefulItem = (String, Scope, Arc<Mutex<dyn Stateful>>);

/// The tensors and [`Stateful`] items registered with a manager.
#[derive(Default)]
pub(crate) struct Registry {
    tensors: Vec<Registered>,
    stateful: Vec<StatefulItem>,
}

impl Registry {
    /// Register a tensor saved by the placement rules (see
    /// [`super::CheckpointManager::register`]).
    pub(crate) fn register(
        &mut self,
        spec: TensorSpec,
        held: NdBox,
        memory: Arc<dyn TensorMemory>,
    ) -> Result<()> {
        self.add(spec, held, memory, Saves::Placed)
    }

    /// Register a tensor whose held box is saved as it is, by this rank or by `replica_of`
    /// (see [`super::CheckpointManager::register_held`]).
    pub(crate) fn register_held(
        &mut self,
        cfg: &CheckpointerConfig,
        spec: TensorSpec,
        held: NdBox,
        memory: Arc<dyn TensorMemory>,
        replica_of: Option<u32>,
    ) -> Result<()> {
        if let Some(w) = replica_of
            && (w >= cfg.layout.world() || w == cfg.rank)
        {
            return Err(Error::invalid(format!(
                "tensor {:?}: rank {} cannot hold a replica of rank {w}'s box in a world of {} ranks",
                spec.name,
                cfg.rank,
                cfg.layout.world()
            )));
        }
        self.add(spec, held, memory, Saves::Held(replica_of))
    }

    fn add(
        &mut self,
        spec: TensorSpec,
        held: NdBox,
        memory: Arc<dyn TensorMemory>,
        saves: Saves,
    ) -> Result<()> {
        if !held.within(&spec.shape) {
            return Err(Error::invalid(format!(
                "tensor {:?}: held box {held} does not fit the shape {:?}",
                spec.name, spec.shape
            )));
        }
        if self.tensors.iter().any(|t| t.spec.name == spec.name) {
            return Err(Error::invalid(format!(
                "tensor {:?} is registered twice",
                spec.name
            )));
        }
        self.tensors.push(Registered {
            spec,
            held,
            memory,
            saves,
            trainable: false,
        });
        Ok(())
    }

    /// Mark a registered tensor as one training changes (or not).
    pub(crate) fn set_trainable(&mut self, name: &str, trainable: bool) -> Result<()> {
        let t = self
            .tensors
            .iter_mut()
            .find(|t| t.spec.name == name)
            .ok_or_else(|| Error::invalid(format!("tensor {name:?} is not registered")))?;
        t.trainable = trainable;
        Ok(())
    }

    /// The names of the tensors marked trainable.
    pub(crate) fn trainable_names(&self) -> std::collections::HashSet<String> {
        self.tensors
            .iter()
            .filter(|t| t.trainable)
            .map(|t| t.spec.name.clone())
            .collect()
    }

    /// Forget every registered tensor.
    pub(crate) fn clear_tensors(&mut self) {
        self.tensors.clear();
    }

    /// The number of registered tensors.
    pub(crate) fn tensor_count(&self) -> usize {
        self.tensors.len()
    }

    /// The names of the registered tensors.
    pub(crate) fn tensor_names(&self) -> impl Iterator<Item = String> + '_ {
        self.tensors.iter().map(|r| r.spec.name.clone())
    }

    /// Register non-tensor state.
    pub(crate) fn register_stateful(
        &mut self,
        name: &str,
        scope: Scope,
        item: Arc<Mutex<dyn Stateful>>,
    ) -> Result<()> {
        ckpt_store::model::validate_name(name)?;
        if name == MONITOR_BLOB || self.stateful.iter().any(|(n, _, _)| n == name) {
            return Err(Error::invalid(format!(
                "stateful item {name:?} is registered twice or reserved"
            )));
        }
        self.stateful.push((name.to_string(), scope, item));
        Ok(())
    }

    /// The boxes this rank saves under `cfg`'s layout (in the order the tensors were
    /// registered), the [`Stateful`] items' blobs and the monitor's state (when it is enabled).
    pub(crate) fn save_state(
        &self,
        cfg: &CheckpointerConfig,
        monitor: &Monitor,
    ) -> Result<SaveState> {
        let placed = self.placed(cfg)?;
        let mut tensors = Vec::new();
        for (i, r) in self.tensors.iter().enumerate() {
            match r.saves {
                Saves::Held(replica_of) => tensors.push(r.held_box(replica_of)?),
                Saves::Placed => {
                    for p in placed.get(&i).map(Vec::as_slice).unwrap_or(&[]) {
                        tensors.push(r.placed_box(cfg, p)?);
                    }
                }
            }
        }
        let mut blobs = Vec::new();
        for (name, scope, item) in &self.stateful {
            match scope {
                Scope::Global if cfg.rank == 0 => {
                    blobs.push((format!("global/{name}"), item.lock().state_dict()))
                }
                Scope::Global => {}
                Scope::PerRank => blobs.push((format!("rank/{name}"), item.lock().state_dict())),
            }
        }
        if monitor.enabled() {
            let state = serde_json::to_vec(&monitor.state())
                .map_err(|e| Error::internal(format!("monitor state: {e}")))?;
            blobs.push((format!("rank/{MONITOR_BLOB}"), state));
        }
        Ok(SaveState { tensors, blobs })
    }

    /// The boxes the placement rules assign to this rank, by the index of the tensor
    /// (registered with `register`) they belong to.
    fn placed(&self, cfg: &CheckpointerConfig) -> Result<HashMap<usize, Vec<ckpt_store::Placed>>> {
        let placed_idx: Vec<usize> = (0..self.tensors.len())
            .filter(|&i| self.tensors[i].saves == Saves::Placed)
            .collect();
        let specs: Vec<TensorSpec> = placed_idx
            .iter()
            .map(|&i| self.tensors[i].spec.clone())
            .collect();
        let mut by_spec: HashMap<usize, Vec<ckpt_store::Placed>> = HashMap::new();
        for p in place_rank(&cfg.layout, cfg.rank, &specs)? {
            by_spec.entry(placed_idx[p.spec]).or_default().push(p);
        }
        Ok(by_spec)
    }

    /// What a restore fills: every registered tensor's whole held box.
    pub(crate) fn restore_targets(&self) -> Result<Vec<RestoreTarget>> {
        let mut targets = Vec::with_capacity(self.tensors.len());
        for r in &self.tensors {
            let elem = r.spec.dtype.size();
            targets.push(RestoreTarget {
                name: r.spec.name.clone(),
                dtype: r.spec.dtype,
                shape: r.spec.shape.clone(),
                bbox: r.held.clone(),
                sink: r.memory.sink(&r.held, elem)?,
            });
        }
        Ok(targets)
    }

    /// Load every [`Stateful`] item from `reader`'s step: global items from rank 0, per-rank
    /// ones from this rank when the layout is the same (else left as they are, with a
    /// warning).
    pub(crate) fn load_stateful(
        &self,
        reader: &StepReader,
        cfg: &CheckpointerConfig,
        same_layout: bool,
    ) -> Result<()> {
        let step = reader.commit().step;
        for (name, scope, item) in &self.stateful {
            let (rank, blob) = match scope {
                Scope::Global => (0, format!("global/{name}")),
                Scope::PerRank if same_layout => (cfg.rank, format!("rank/{name}")),
                Scope::PerRank => {
                    warn!(
                        name,
                        "per-rank state not restored: the job was resharded from {} to {}",
                        reader.commit().layout,
                        cfg.layout
                    );
                    continue;
                }
            };
            let bytes = runtime().block_on(reader.read_blob(rank, &blob))?;
            item.lock().load_state_dict(&bytes).map_err(|e| {
                e.context(format!(
                    "restoring {name:?} from step {step} of run {}",
                    cfg.run
                ))
            })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::monitor::MonitorConfig;
    use ckpt_store::DType;

    fn spec(name: &str, shape: &[u64], tp_dim: Option<usize>) -> TensorSpec {
        TensorSpec::first_stage(name, DType::F32, shape).with_tp(tp_dim)
    }

    fn memory(elems: usize) -> Arc<dyn TensorMemory> {
        Arc::new(HostTensor::from_vec(vec![0; elems * 4]))
    }

    struct Item(Vec<u8>);
    impl Stateful for Item {
        fn state_dict(&self) -> Vec<u8> {
            self.0.clone()
        }
        fn load_state_dict(&mut self, bytes: &[u8]) -> Result<()> {
            self.0 = bytes.to_vec();
            Ok(())
        }
    }

    fn cfg(rank: u32, layout: &str) -> CheckpointerConfig {
        CheckpointerConfig::new("r", rank, layout.parse().unwrap())
    }

    #[test]
    fn registering_checks_names_boxes_and_writers() {
        let mut r = Registry::default();
        let full = NdBox::full(&[4, 4]);
        r.register(spec("a", &[4, 4], None), full.clone(), memory(16))
            .unwrap();
        assert!(
            r.register(spec("a", &[4, 4], None), full.clone(), memory(16))
                .is_err()
        );
        assert!(
            r.register(spec("b", &[2, 2], None), full.clone(), memory(16))
                .is_err()
        );
        let c = cfg(1, "dp=2,tp=1,pp=1");
        for bad in [Some(1), Some(2)] {
            let e = r.register_held(&c, spec("h", &[4, 4], None), full.clone(), memory(16), bad);
            assert!(e.is_err(), "{bad:?}");
        }
        r.register_held(&c, spec("h", &[4, 4], None), full, memory(16), Some(0))
            .unwrap();
        assert_eq!(r.tensor_count(), 2);
        assert_eq!(r.tensor_names().collect::<Vec<_>>(), ["a", "h"]);
        let item = Arc::new(Mutex::new(Item(vec![1])));
        r.register_stateful("data", Scope::Global, item.clone())
            .unwrap();
        assert!(
            r.register_stateful("data", Scope::PerRank, item.clone())
                .is_err()
        );
        assert!(
            r.register_stateful(MONITOR_BLOB, Scope::PerRank, item)
                .is_err()
        );
        r.clear_tensors();
        assert_eq!(r.tensor_count(), 0);
    }

    #[test]
    fn a_save_writes_placed_and_held_boxes_in_registration_order() {
        let c = cfg(1, "dp=1,tp=2,pp=1");
        let mut r = Registry::default();
        r.register(
            spec("p", &[4, 4], Some(0)),
            NdBox::full(&[4, 4]),
            memory(16),
        )
        .unwrap();
        let held = NdBox::new(vec![2, 0], vec![2, 4]).unwrap();
        r.register_held(&c, spec("h", &[4, 4], None), held.clone(), memory(8), None)
            .unwrap();
        r.register(spec("q", &[6], None), NdBox::full(&[6]), memory(6))
            .unwrap();
        r.register_stateful("g", Scope::Global, Arc::new(Mutex::new(Item(vec![1]))))
            .unwrap();
        r.register_stateful("l", Scope::PerRank, Arc::new(Mutex::new(Item(vec![2]))))
            .unwrap();
        let off = Monitor::new(MonitorConfig::default());
        let s = r.save_state(&c, &off).unwrap();
        let names: Vec<&str> = s.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names[..2], ["p", "h"]);
        assert_eq!(
            s.tensors[0].bbox,
            NdBox::new(vec![2, 0], vec![2, 4]).unwrap()
        );
        assert!(s.tensors[0].placement.is_some());
        assert_eq!(s.tensors[1].bbox, held);
        assert!(s.tensors[1].placement.is_none() && s.tensors[1].source.is_some());
        // Rank 1 writes no global item.
        let blobs: Vec<&str> = s.blobs.iter().map(|b| b.0.as_str()).collect();
        assert_eq!(blobs, ["rank/l"]);
        let s0 = r.save_state(&cfg(0, "dp=1,tp=2,pp=1"), &off).unwrap();
        assert_eq!(s0.blobs[0], ("global/g".to_string(), vec![1]));
    }

    #[test]
    fn a_placed_box_outside_the_held_box_is_refused() {
        let c = cfg(1, "dp=1,tp=2,pp=1");
        let mut r = Registry::default();
        let top = NdBox::new(vec![0, 0], vec![2, 4]).unwrap();
        r.register(spec("p", &[4, 4], Some(0)), top, memory(8))
            .unwrap();
        let off = Monitor::new(MonitorConfig::default());
        let e = r.save_state(&c, &off).unwrap_err().to_string();
        assert!(e.contains("holds only"), "{e}");
    }

    #[test]
    fn restore_targets_are_the_held_boxes() {
        let mut r = Registry::default();
        r.register(spec("p", &[4, 4], None), NdBox::full(&[4, 4]), memory(16))
            .unwrap();
        let t = r.restore_targets().unwrap();
        assert_eq!(
            (t[0].name.as_str(), &t[0].bbox),
            ("p", &NdBox::full(&[4, 4]))
        );
        let mut bad = Registry::default();
        bad.register(spec("p", &[4, 4], None), NdBox::full(&[4, 4]), memory(3))
            .unwrap();
        assert!(bad.restore_targets().is_err());
    }
}
