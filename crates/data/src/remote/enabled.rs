//! Remote shards through `object_store` (S3, GCS, HTTP, local files), driven by a small tokio
//! runtime owned by the source. Endpoints and credentials come from the variables the cloud tools
//! read (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, ..., `GOOGLE_SERVICE_ACCOUNT`, ...), as the
//! checkpoint mirror takes them.

use std::io::Write;
use std::sync::Arc;

use futures::StreamExt;
use object_store::path::Path as StorePath;
use object_store::ObjectStore;

use crate::cache::ShardSource;
use crate::DataError;

struct ObjectStoreSource {
    url: String,
    store: Box<dyn ObjectStore>,
    prefix: StorePath,
    runtime: tokio::runtime::Runtime,
}

impl ShardSource for ObjectStoreSource {
    fn describe(&self, name: &str) -> String {
        format!("{}/{name}", self.url.trim_end_matches('/'))
    }

    fn fetch(&self, name: &str, out: &mut dyn Write) -> Result<u64, DataError> {
        let location = self.prefix.child(name);
        let remote = |detail: String| DataError::Remote { url: self.describe(name), detail };
        self.runtime.block_on(async {
            let result = self.store.get(&location).await.map_err(|err| remote(err.to_string()))?;
            let mut stream = result.into_stream();
            let mut written = 0u64;
            while let Some(chunk) = stream.next().await {
                let chunk = chunk.map_err(|err| remote(err.to_string()))?;
                out.write_all(&chunk).map_err(|err| remote(format!("writing the download: {err}")))?;
                written += chunk.len() as u64;
            }
            Ok(written)
        })
    }
}

pub(super) fn object_store_source(location: &str) -> Result<Arc<dyn ShardSource>, DataError> {
    let remote = |detail: String| DataError::Remote { url: location.to_string(), detail };
    let url = url::Url::parse(location).map_err(|err| remote(err.to_string()))?;
    let (store, prefix) = object_store::parse_url_opts(&url, store_options_from_env(std::env::vars()))
        .map_err(|err| remote(err.to_string()))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|err| remote(format!("cannot start the I/O runtime: {err}")))?;
    Ok(Arc::new(ObjectStoreSource { url: location.to_string(), store, prefix, runtime }))
}

/// The `AWS_*` and `GOOGLE_*` variables as object_store's configuration keys (`aws_endpoint_url`,
/// ...); the builders ignore keys they do not know.
fn store_options_from_env(vars: impl Iterator<Item = (String, String)>) -> Vec<(String, String)> {
    vars.filter(|(key, _)| key.starts_with("AWS_") || key.starts_with("GOOGLE_"))
        .map(|(key, value)| (key.to_ascii_lowercase(), value))
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::cache::{CacheConfig, ShardCache};

    /// The cache against object_store's LocalFileSystem, through a `file://` URL.
    #[test]
    fn cache_over_object_store_local_files() {
        let root = tempfile::tempdir().unwrap();
        let remote = root.path().join("remote");
        std::fs::create_dir_all(&remote).unwrap();
        std::fs::write(remote.join("a"), vec![1u8; 100]).unwrap();
        std::fs::write(remote.join("b"), vec![2u8; 100]).unwrap();
        let url = format!("file://{}", remote.display());
        let source = super::object_store_source(&url).unwrap();
        let config = CacheConfig { dir: root.path().join("cache"), budget_bytes: 150 };
        let cache = Arc::new(ShardCache::open(&config, source).unwrap());
        let path = cache.get("a", Some(crc32fast::hash(&[1u8; 100]))).unwrap();
        assert_eq!(std::fs::read(path).unwrap(), vec![1u8; 100]);
        cache.get("b", None).unwrap();
        assert!(!cache.contains("a") && cache.contains("b"), "a was evicted for b");
        assert!(cache.get("a", Some(0)).is_err(), "a checksum mismatch is an error");
        assert!(cache.get("missing", None).is_err());
    }

    /// Only the cloud tools' variables become options, under object_store's lower-case keys.
    #[test]
    fn store_options_are_the_cloud_variables_in_lower_case() {
        let vars = [("AWS_ENDPOINT_URL", "http://127.0.0.1:9000"), ("HOME", "/root"), ("GOOGLE_BUCKET", "b")];
        let options = super::store_options_from_env(vars.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        let expected = [("aws_endpoint_url", "http://127.0.0.1:9000"), ("google_bucket", "b")];
        assert_eq!(options, expected.map(|(k, v)| (k.to_string(), v.to_string())));
    }
}
