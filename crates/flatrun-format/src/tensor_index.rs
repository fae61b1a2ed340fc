//! Name → position lookup shared by the backends, answering both canonical
//! and original names.

use std::collections::HashMap;

use crate::TensorInfo;

/// Finds a tensor by canonical or original name.
#[derive(Debug, Default, Clone)]
pub struct TensorIndex {
    by_name: HashMap<String, usize>,
}

impl TensorIndex {
    /// Index `tensors`; canonical names win over original names on clashes.
    pub fn new(tensors: &[TensorInfo]) -> TensorIndex {
        let mut by_name = HashMap::with_capacity(tensors.len() * 2);
        for (i, t) in tensors.iter().enumerate() {
            by_name.entry(t.original_name.clone()).or_insert(i);
        }
        for (i, t) in tensors.iter().enumerate() {
            by_name.insert(t.name.clone(), i);
        }
        TensorIndex { by_name }
    }

    /// Position of the tensor called `name`.
    pub fn find(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }
}
