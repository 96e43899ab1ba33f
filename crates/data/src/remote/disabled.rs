//! Built without the `remote` feature: URLs are refused with a message saying how to enable them.

use std::sync::Arc;

use crate::cache::ShardSource;
use crate::DataError;

pub(super) fn object_store_source(location: &str) -> Result<Arc<dyn ShardSource>, DataError> {
    Err(DataError::Remote {
        url: location.to_string(),
        detail: "this build has no remote storage support (build stoke-data with the `remote` feature)".into(),
    })
}
