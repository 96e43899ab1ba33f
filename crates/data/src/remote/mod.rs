//! Opening a prepared token directory that lives elsewhere: a URL (`s3://`, `gs://`, `http(s)://`,
//! `file://`, with the `remote` feature) or a plain directory path (always), read through a local
//! `ShardCache`. Shards are mapped one by one as they arrive while a background thread prefetches the
//! next ones; each download is checked against the crc32 in the manifest.

use std::sync::Arc;

use crate::cache::{CacheConfig, LocalDirSource, ShardCache, ShardSource};
use crate::format::{TokenManifest, TOKEN_MANIFEST};
use crate::tokens::TokenStore;
use crate::DataError;

#[cfg(feature = "remote")]
mod enabled;
#[cfg(feature = "remote")]
use enabled as imp;
#[cfg(not(feature = "remote"))]
mod disabled;
#[cfg(not(feature = "remote"))]
use disabled as imp;

/// Whether `location` names remote storage (a URL with a scheme other than a Windows drive).
pub fn is_remote(location: &str) -> bool {
    location.split_once("://").is_some_and(|(scheme, _)| scheme.len() > 1)
}

/// The source for `location`: object storage for URLs, a directory otherwise.
pub fn shard_source(location: &str) -> Result<Arc<dyn ShardSource>, DataError> {
    if is_remote(location) {
        return imp::object_store_source(location);
    }
    Ok(Arc::new(LocalDirSource { dir: location.into() }))
}

/// Opens the prepared directory at `location` through a cache; returns the store and the cache.
pub fn open_cached(location: &str, cache: &CacheConfig) -> Result<(TokenStore, Arc<ShardCache>), DataError> {
    let cache = Arc::new(ShardCache::open(cache, shard_source(location)?)?);
    // The manifest is small and may change; fetch it fresh every time, outside the cache.
    let mut manifest_bytes = Vec::new();
    cache.source().fetch(TOKEN_MANIFEST, &mut manifest_bytes)?;
    let manifest_name = cache.source().describe(TOKEN_MANIFEST);
    let manifest = TokenManifest::parse(manifest_name.as_ref(), &manifest_bytes)?;
    let wanted: Vec<(String, Option<u32>)> = manifest
        .shards
        .iter()
        .flat_map(|s| [(s.idx.clone(), Some(s.idx_crc32)), (s.bin.clone(), Some(s.bin_crc32))])
        .collect();
    // Prefetch everything after the first shard while the first is fetched and mapped here.
    let prefetch = cache.prefetch(wanted.iter().skip(2).cloned().collect());
    let store = TokenStore::open_manifest(&manifest, &manifest_name, |name| {
        let crc = wanted.iter().find(|(n, _)| n == name).and_then(|(_, crc)| *crc);
        cache.get(name, crc)
    });
    // Report a prefetch failure only if opening did not already fail on the same file.
    let prefetched = prefetch.join().unwrap_or(Ok(()));
    let store = store?;
    prefetched?;
    Ok((store, cache))
}
