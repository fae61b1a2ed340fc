//! The models one server answers for, the first (the default, for requests
//! naming none) and any others by name, and when each is in memory.
//!
//! A model comes either loaded by the caller into an [`EngineSlot`]
//! ([`ModelSet::add`]; it stays until the server stops) or as a
//! [`ModelLoader`] ([`ModelSet::add_loader`]): then it is loaded on the
//! first request that names it (that request and any arriving meanwhile
//! wait for it) and unloaded again when idle. Under a memory budget
//! ([`ModelPolicy::max_resident`]) each load gets what the budget has left
//! (less a reserve that lets the models not loaded yet run streamed), and
//! the loader picks the residency that fits it: resident while the whole
//! model fits, a cap on the kept layers beyond that, streamed when little
//! is left. To make room, idle models are unloaded least recently used
//! first; a model with requests in flight is never unloaded. With
//! [`ModelPolicy::keep_alive`], a model idle that long is unloaded too.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::engine::Engine;
use crate::state::EngineSlot;

/// Loads one served model on demand.
pub trait ModelLoader: Send + Sync + 'static {
    /// What the model needs, planned from its header (cheap; called once).
    fn footprint(&self) -> Result<Footprint, String>;
    /// Loads it, keeping within `budget` bytes when there is a budget.
    /// Runs on a blocking thread.
    fn load(&self, budget: Option<u64>) -> Result<LoadedModel, String>;
    /// Told when the model was unloaded, and why (to log it).
    fn unloaded(&self, _why: &str) {}
}

/// Peak memory of a model's plans (weights kept, read buffers, KV cache,
/// work buffers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Footprint {
    /// With every weight resident.
    pub resident: u64,
    /// The least it runs in (stream mode).
    pub least: u64,
}

/// A model [`ModelLoader::load`] made ready.
pub struct LoadedModel {
    pub engine: Arc<dyn Engine>,
    /// Peak memory of the plan it was loaded with.
    pub memory_bytes: u64,
    /// The residency chosen (`resident`, `cap=…`, `stream`).
    pub residency: String,
}

/// When loaded models are unloaded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ModelPolicy {
    /// Peak memory all loaded models may plan for together (bytes).
    pub max_resident: Option<u64>,
    /// Unload a model idle for this long.
    pub keep_alive: Option<Duration>,
}

/// Why a model could not be had.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AcquireError {
    /// Loaded by the caller, which has not installed it yet.
    #[error("the model is still loading")]
    Loading,
    /// Its loader failed.
    #[error("model `{name}` could not be loaded: {message}")]
    LoadFailed { name: String, message: String },
    /// Even streamed it does not fit what the budget has left, and every
    /// other model holding memory is busy.
    #[error(
        "model `{name}` needs {needed} bytes at least, but only {free} of the {budget}-byte memory budget \
         are free and the models holding the rest are busy"
    )]
    NoMemory {
        name: String,
        needed: u64,
        free: u64,
        budget: u64,
    },
}

/// One model's state, as `/metrics` and `/v1/models` report it.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelStatus {
    pub name: String,
    pub loaded: bool,
    /// Residency it is loaded with (managed models).
    pub residency: Option<String>,
    /// Peak memory of its plan (managed models that are loaded).
    pub memory_bytes: u64,
    pub loads: u64,
    pub unloads: u64,
}

/// Every served model, the default first.
#[derive(Clone)]
pub struct ModelSet(Arc<Shared>);

struct Shared {
    policy: ModelPolicy,
    table: Mutex<Vec<Entry>>,
}

struct Entry {
    /// `None` for a default whose name comes from its engine.
    name: Option<String>,
    source: Source,
    loads: u64,
    unloads: u64,
}

enum Source {
    External(EngineSlot),
    Managed {
        loader: Arc<dyn ModelLoader>,
        footprint: Option<Footprint>,
        state: State,
    },
}

enum State {
    Unloaded,
    /// Being loaded: the outcome arrives on the channel.
    Loading {
        reserved: u64,
        done: watch::Receiver<Option<Result<(), String>>>,
    },
    Ready {
        engine: Arc<dyn Engine>,
        memory_bytes: u64,
        residency: String,
        last_used: Instant,
    },
}

/// What [`ModelSet::acquire`] does once the table's lock is released.
enum Step {
    Done(Arc<dyn Engine>),
    Wait(watch::Receiver<Option<Result<(), String>>>),
    Plan(Arc<dyn ModelLoader>),
    Load {
        loader: Arc<dyn ModelLoader>,
        budget: Option<u64>,
        evicted: Vec<Arc<dyn Engine>>,
        done: watch::Sender<Option<Result<(), String>>>,
    },
}

impl Default for ModelSet {
    fn default() -> Self {
        ModelSet::new(ModelPolicy::default(), EngineSlot::default())
    }
}

impl ModelSet {
    /// A set whose default model is the one installed into `default`.
    pub fn new(policy: ModelPolicy, default: EngineSlot) -> ModelSet {
        ModelSet(Arc::new(Shared {
            policy,
            table: Mutex::new(vec![Entry {
                name: None,
                source: Source::External(default),
                loads: 0,
                unloads: 0,
            }]),
        }))
    }

    fn table(&self) -> MutexGuard<'_, Vec<Entry>> {
        self.0.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The policy models are loaded and unloaded by.
    pub fn policy(&self) -> ModelPolicy {
        self.0.policy
    }

    /// Registers `name`, loaded by the caller into the slot returned;
    /// `None` when the name is already taken.
    pub fn add(&self, name: &str) -> Option<EngineSlot> {
        let slot = EngineSlot::default();
        self.push(name, Source::External(slot.clone()))
            .then_some(slot)
    }

    /// Registers `name`, loaded by `loader` on first use; false when the
    /// name is already taken.
    pub fn add_loader(&self, name: &str, loader: Arc<dyn ModelLoader>) -> bool {
        self.push(name, managed(loader))
    }

    /// Makes `loader` the default model's, served as `name`.
    pub fn set_default_loader(&self, name: &str, loader: Arc<dyn ModelLoader>) {
        let mut table = self.table();
        table[0].name = Some(name.to_string());
        table[0].source = managed(loader);
    }

    fn push(&self, name: &str, source: Source) -> bool {
        let mut table = self.table();
        if table.iter().any(|e| e.name.as_deref() == Some(name)) {
            return false;
        }
        table.push(Entry {
            name: Some(name.to_string()),
            source,
            loads: 0,
            unloads: 0,
        });
        true
    }

    /// The default model's engine if it is in memory now.
    pub fn default_engine(&self) -> Option<Arc<dyn Engine>> {
        loaded(&self.table()[0])
    }

    /// Whether the default model has been ready once (the server is
    /// ready: a managed default unloaded since loads again on demand).
    pub fn default_ready(&self) -> bool {
        let table = self.table();
        match &table[0].source {
            Source::External(slot) => slot.get().is_some(),
            Source::Managed { .. } => table[0].loads > 0,
        }
    }

    /// The default model's name: its own, else `engine`'s.
    pub fn default_name(&self) -> Option<String> {
        let table = self.table();
        table[0]
            .name
            .clone()
            .or_else(|| loaded(&table[0]).map(|e| e.model_name().to_string()))
    }

    /// Every registered name after the default, in order.
    pub fn names(&self) -> Vec<String> {
        self.table()
            .iter()
            .skip(1)
            .filter_map(|e| e.name.clone())
            .collect()
    }

    /// Where `name` is in the table (`None` and `""` are the default).
    pub fn index_of(&self, name: Option<&str>) -> Option<usize> {
        match name {
            None | Some("") => Some(0),
            Some(name) => self
                .table()
                .iter()
                .position(|e| e.name.as_deref() == Some(name)),
        }
    }

    /// Every engine in memory now.
    pub fn loaded_engines(&self) -> Vec<Arc<dyn Engine>> {
        self.table().iter().filter_map(loaded).collect()
    }

    /// Each model's state, the default first (under `default_name` when it
    /// names itself through its engine).
    pub fn status(&self) -> Vec<ModelStatus> {
        let table = self.table();
        table
            .iter()
            .map(|e| {
                let (residency, memory_bytes) = match &e.source {
                    Source::Managed {
                        state:
                            State::Ready {
                                residency,
                                memory_bytes,
                                ..
                            },
                        ..
                    } => (Some(residency.clone()), *memory_bytes),
                    _ => (None, 0),
                };
                ModelStatus {
                    name: e
                        .name
                        .clone()
                        .or_else(|| loaded(e).map(|x| x.model_name().to_string()))
                        .unwrap_or_default(),
                    loaded: loaded(e).is_some(),
                    residency,
                    memory_bytes,
                    loads: e.loads,
                    unloads: e.unloads,
                }
            })
            .collect()
    }

    /// The engine of the model at `index` (from [`ModelSet::index_of`]),
    /// loading it first if it is not in memory.
    pub async fn acquire(&self, index: usize) -> Result<Arc<dyn Engine>, AcquireError> {
        loop {
            match self.next_step(index)? {
                Step::Done(engine) => return Ok(engine),
                Step::Wait(mut done) => {
                    let outcome = done.wait_for(|d| d.is_some()).await.map(|d| d.clone());
                    if let Ok(Some(Err(message))) = outcome {
                        return Err(AcquireError::LoadFailed {
                            name: self.name_at(index),
                            message,
                        });
                    }
                }
                Step::Plan(loader) => {
                    let footprint = tokio::task::spawn_blocking(move || loader.footprint())
                        .await
                        .map_err(|e| e.to_string())
                        .and_then(|r| r);
                    let footprint = footprint.map_err(|message| AcquireError::LoadFailed {
                        name: self.name_at(index),
                        message,
                    })?;
                    if let Source::Managed { footprint: f, .. } = &mut self.table()[index].source {
                        *f = Some(footprint);
                    }
                }
                Step::Load {
                    loader,
                    budget,
                    evicted,
                    done,
                } => return self.load(index, loader, budget, evicted, done).await,
            }
        }
    }

    fn name_at(&self, index: usize) -> String {
        self.table()
            .get(index)
            .and_then(|e| e.name.clone())
            .unwrap_or_default()
    }

    /// Under the lock: what to do for the model at `index`, reserving its
    /// memory and choosing what to unload when it is to be loaded.
    fn next_step(&self, index: usize) -> Result<Step, AcquireError> {
        let budget = self.0.policy.max_resident;
        let mut table = self.table();
        let used = memory_in_use(&table);
        let name = table[index].name.clone().unwrap_or_default();
        if let Source::External(slot) = &table[index].source {
            return slot
                .get()
                .cloned()
                .map(Step::Done)
                .ok_or(AcquireError::Loading);
        }
        let Source::Managed {
            loader,
            footprint,
            state,
        } = &mut table[index].source
        else {
            unreachable!("not external, so managed")
        };
        match state {
            State::Ready {
                engine, last_used, ..
            } => {
                *last_used = Instant::now();
                return Ok(Step::Done(engine.clone()));
            }
            State::Loading { done, .. } => return Ok(Step::Wait(done.clone())),
            State::Unloaded => {}
        }
        let Some(footprint) = *footprint else {
            return Ok(Step::Plan(loader.clone()));
        };
        let loader = loader.clone();
        let (grant, evicted) = match budget {
            None => (None, Vec::new()),
            Some(budget) => {
                let free = budget.saturating_sub(used);
                let reserve = stream_reserve(&table, index, footprint, budget);
                let victims = make_room(&table, index, free.saturating_sub(reserve), footprint);
                let freed: u64 = victims.iter().map(|&i| memory_of(&table[i])).sum();
                let free = free + freed;
                if free < footprint.least {
                    return Err(AcquireError::NoMemory {
                        name,
                        needed: footprint.least,
                        free,
                        budget,
                    });
                }
                let why = format!("idle, to make room for `{name}`");
                let evicted = victims
                    .into_iter()
                    .filter_map(|i| unload(&mut table[i], &why))
                    .collect();
                // What is kept for the models not loaded goes to this one
                // only when it could not run without it.
                let grant = match free.checked_sub(reserve) {
                    Some(grant) if grant >= footprint.least => grant,
                    _ => free,
                };
                (Some(grant), evicted)
            }
        };
        let (tx, rx) = watch::channel(None);
        if let Source::Managed { state, .. } = &mut table[index].source {
            *state = State::Loading {
                reserved: grant.map_or(0, |free| free.min(footprint.resident)),
                done: rx,
            };
        }
        Ok(Step::Load {
            loader,
            budget: grant,
            evicted,
            done: tx,
        })
    }

    async fn load(
        &self,
        index: usize,
        loader: Arc<dyn ModelLoader>,
        budget: Option<u64>,
        evicted: Vec<Arc<dyn Engine>>,
        done: watch::Sender<Option<Result<(), String>>>,
    ) -> Result<Arc<dyn Engine>, AcquireError> {
        let result = tokio::task::spawn_blocking(move || {
            // Their scheduler threads stop (and their memory is freed)
            // before the new model maps its own.
            drop(evicted);
            loader.load(budget)
        })
        .await
        .map_err(|e| format!("the loader panicked: {e}"))
        .and_then(|r| r);
        let mut table = self.table();
        let entry = &mut table[index];
        let Source::Managed { state, .. } = &mut entry.source else {
            unreachable!("a loading entry is managed")
        };
        match result {
            Ok(model) => {
                tracing::info!(
                    "loaded model `{}`: residency {}, planned peak {} bytes",
                    entry.name.as_deref().unwrap_or_default(),
                    model.residency,
                    model.memory_bytes
                );
                let engine = model.engine.clone();
                *state = State::Ready {
                    engine: model.engine,
                    memory_bytes: model.memory_bytes,
                    residency: model.residency,
                    last_used: Instant::now(),
                };
                entry.loads += 1;
                let _ = done.send(Some(Ok(())));
                Ok(engine)
            }
            Err(message) => {
                *state = State::Unloaded;
                let _ = done.send(Some(Err(message.clone())));
                Err(AcquireError::LoadFailed {
                    name: entry.name.clone().unwrap_or_default(),
                    message,
                })
            }
        }
    }

    /// Unloads the managed models idle for at least `idle`, returning
    /// their engines (drop them off the async threads: dropping joins the
    /// scheduler thread). A model seen busy counts as used now.
    pub fn unload_idle(&self, idle: Duration) -> Vec<Arc<dyn Engine>> {
        let now = Instant::now();
        let mut table = self.table();
        let mut unloaded = Vec::new();
        for entry in table.iter_mut() {
            let expired = match &mut entry.source {
                Source::Managed {
                    state:
                        State::Ready {
                            engine, last_used, ..
                        },
                    ..
                } => {
                    if !is_idle(engine) {
                        *last_used = now;
                    }
                    now.duration_since(*last_used) >= idle
                }
                _ => false,
            };
            if expired {
                unloaded.extend(unload(entry, "idle"));
            }
        }
        unloaded
    }

    /// Runs [`ModelSet::unload_idle`] with the keep-alive every so often,
    /// until the set is dropped; a no-op without a keep-alive.
    pub fn spawn_keep_alive(&self) {
        let Some(keep_alive) = self.0.policy.keep_alive else {
            return;
        };
        let tick = (keep_alive / 4).clamp(Duration::from_millis(50), Duration::from_secs(5));
        let weak = Arc::downgrade(&self.0);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(tick).await;
                let Some(shared) = weak.upgrade() else { return };
                let unloaded = ModelSet(shared).unload_idle(keep_alive);
                if !unloaded.is_empty() {
                    tokio::task::spawn_blocking(move || drop(unloaded));
                }
            }
        });
    }
}

fn managed(loader: Arc<dyn ModelLoader>) -> Source {
    Source::Managed {
        loader,
        footprint: None,
        state: State::Unloaded,
    }
}

fn loaded(entry: &Entry) -> Option<Arc<dyn Engine>> {
    match &entry.source {
        Source::External(slot) => slot.get().cloned(),
        Source::Managed {
            state: State::Ready { engine, .. },
            ..
        } => Some(engine.clone()),
        Source::Managed { .. } => None,
    }
}

/// Memory a managed entry holds or has reserved.
fn memory_of(entry: &Entry) -> u64 {
    match &entry.source {
        Source::Managed {
            state: State::Ready { memory_bytes, .. },
            ..
        } => *memory_bytes,
        Source::Managed {
            state: State::Loading { reserved, .. },
            ..
        } => *reserved,
        _ => 0,
    }
}

fn memory_in_use(table: &[Entry]) -> u64 {
    table.iter().map(memory_of).sum()
}

/// No request holds it (only the table does) and nothing runs or waits in it.
fn is_idle(engine: &Arc<dyn Engine>) -> bool {
    let stats = engine.stats();
    Arc::strong_count(engine) == 1 && stats.active_sequences == 0 && stats.queued_requests == 0
}

/// Share of the budget at most kept back, while models load, for the
/// served models not loaded yet to run streamed.
const STREAM_RESERVE_SHARE: u64 = 4;

/// The memory kept back for the models not loaded (other than the one at
/// `index`) to run at least streamed when their requests come: their
/// number times the largest stream-mode footprint known, at most a quarter
/// of the budget. Without it, models that do not fit whole would take all
/// that is left as a cap, and the next model could not even stream.
fn stream_reserve(table: &[Entry], index: usize, footprint: Footprint, budget: u64) -> u64 {
    let mut largest = footprint.least;
    let mut waiting = 0u64;
    for (i, entry) in table.iter().enumerate() {
        if let Source::Managed {
            footprint: known,
            state,
            ..
        } = &entry.source
        {
            if let Some(known) = known {
                largest = largest.max(known.least);
            }
            if i != index && matches!(state, State::Unloaded) {
                waiting += 1;
            }
        }
    }
    (waiting * largest).min(budget / STREAM_RESERVE_SHARE)
}

/// The idle models to unload, least recently used first, so that the
/// model at `index` fits whole with `free` bytes free: as many as that
/// takes; if even all of them would not make room for it whole, only as
/// many as it needs to run at all (it then runs capped or streamed).
fn make_room(table: &[Entry], index: usize, free: u64, footprint: Footprint) -> Vec<usize> {
    let mut idle: Vec<(Instant, usize, u64)> = table
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != index)
        .filter_map(|(i, e)| match &e.source {
            Source::Managed {
                state:
                    State::Ready {
                        engine,
                        last_used,
                        memory_bytes,
                        ..
                    },
                ..
            } if is_idle(engine) => Some((*last_used, i, *memory_bytes)),
            _ => None,
        })
        .collect();
    idle.sort();
    let reclaimable: u64 = idle.iter().map(|&(_, _, m)| m).sum();
    let target = if free + reclaimable >= footprint.resident {
        footprint.resident
    } else {
        footprint.least
    };
    let mut free = free;
    let mut victims = Vec::new();
    for (_, i, memory) in idle {
        if free >= target {
            break;
        }
        free += memory;
        victims.push(i);
    }
    victims
}

/// Marks a ready managed entry unloaded, returning its engine.
fn unload(entry: &mut Entry, why: &str) -> Option<Arc<dyn Engine>> {
    let Source::Managed { state, loader, .. } = &mut entry.source else {
        return None;
    };
    match std::mem::replace(state, State::Unloaded) {
        State::Ready { engine, .. } => {
            entry.unloads += 1;
            let name = entry.name.as_deref().unwrap_or_default();
            tracing::info!("unloaded model `{name}` ({why})");
            loader.unloaded(why);
            Some(engine)
        }
        other => {
            *state = other;
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_kept_in_order() {
        let set = ModelSet::default();
        assert!(set.add("a").is_some());
        assert!(set.add("b").is_some());
        assert!(set.add("a").is_none());
        assert_eq!(set.names(), vec!["a", "b"]);
        assert_eq!(set.index_of(Some("b")), Some(2));
        assert_eq!(set.index_of(None), Some(0));
        assert!(set.index_of(Some("c")).is_none());
        assert!(!set.default_ready());
    }
}
