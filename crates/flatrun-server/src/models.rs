//! The models one server answers for beyond its first: each under its name,
//! in its own [`EngineSlot`] (registered before it loads, so a request for
//! a model still loading gets a 503, not a 404). Requests pick theirs by
//! their `model` field ([`crate::AppState::route`]).

use std::sync::{Arc, RwLock};

use crate::state::EngineSlot;

/// Named engines, in the order they were added.
#[derive(Clone, Default)]
pub struct ModelSet(Arc<RwLock<Vec<(String, EngineSlot)>>>);

impl ModelSet {
    /// Registers `name` and returns the slot its engine goes into; `None`
    /// when the name is already taken.
    pub fn add(&self, name: &str) -> Option<EngineSlot> {
        let mut models = self.0.write().unwrap_or_else(|e| e.into_inner());
        if models.iter().any(|(n, _)| n == name) {
            return None;
        }
        let slot = EngineSlot::default();
        models.push((name.to_string(), slot.clone()));
        Some(slot)
    }

    /// The slot of `name`.
    pub fn get(&self, name: &str) -> Option<EngineSlot> {
        let models = self.0.read().unwrap_or_else(|e| e.into_inner());
        models
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, s)| s.clone())
    }

    /// Every registered name, in order.
    pub fn names(&self) -> Vec<String> {
        let models = self.0.read().unwrap_or_else(|e| e.into_inner());
        models.iter().map(|(n, _)| n.clone()).collect()
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
        assert!(set.get("b").is_some_and(|s| s.get().is_none()));
        assert!(set.get("c").is_none());
    }
}
