//! What every [`ObjectStore`](object_store::ObjectStore) wrapper shares, written once: its
//! `Display` as `Name(inner)` ([`wrapper_display!`]), the methods it passes through to its
//! `inner` store unchanged ([`object_store_wrapper!`]), and a multipart upload with hooks
//! before each part and before completing ([`HookedUpload`]).
//!
//! The wrappers: `DirectFs` (`direct/`), `MetricsStore` and `FaultyStore` (`wrap.rs`),
//! `RetryStore` (`retry.rs`), `CountingStore` (`counting.rs`) and `ClockStore` (`testing.rs`).

use async_trait::async_trait;
use object_store::{MultipartUpload, PutPayload, PutResult, Result as OsResult, UploadPart};

/// `impl Display for $ty` as `$name(inner)`, for a wrapper with a field `inner`.
macro_rules! wrapper_display {
    ([$($gen:tt)*] $ty:ty, $name:literal) => {
        impl<$($gen)*> ::std::fmt::Display for $ty {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                write!(f, concat!($name, "({})"), self.inner)
            }
        }
    };
}
pub(crate) use wrapper_display;

/// `impl ObjectStore for $ty` (an `#[async_trait]` impl) from the methods the wrapper writes
/// itself and the names of those it passes through to its field `inner` unchanged:
///
/// ```ignore
/// object_store_wrapper! {
///     impl [S: ObjectStore] for MetricsStore<S>;
///     pass [copy_opts, rename_opts];
///     async fn put_opts(..) -> OsResult<PutResult> { .. }
/// }
/// ```
///
/// A pass-through of a method with a default in `ObjectStore` (`get_ranges`,
/// `list_with_offset`) replaces that default with the inner store's own.
macro_rules! object_store_wrapper {
    (impl [$($gen:tt)*] for $ty:ty; pass [$($pass:ident),* $(,)?]; $($items:tt)*) => {
        $crate::layer::object_store_wrapper!(@pass [$($gen)*] $ty; [$($items)*]; $($pass)*);
    };
    (@pass [$($gen:tt)*] $ty:ty; [$($acc:tt)*]; put_multipart_opts $($rest:ident)*) => {
        $crate::layer::object_store_wrapper!(@pass [$($gen)*] $ty; [$($acc)*
            async fn put_multipart_opts(
                &self,
                location: &::object_store::path::Path,
                opts: ::object_store::PutMultipartOptions,
            ) -> ::object_store::Result<Box<dyn ::object_store::MultipartUpload>> {
                self.inner.put_multipart_opts(location, opts).await
            }
        ]; $($rest)*);
    };
    (@pass [$($gen:tt)*] $ty:ty; [$($acc:tt)*]; get_ranges $($rest:ident)*) => {
        $crate::layer::object_store_wrapper!(@pass [$($gen)*] $ty; [$($acc)*
            async fn get_ranges(
                &self,
                location: &::object_store::path::Path,
                ranges: &[::std::ops::Range<u64>],
            ) -> ::object_store::Result<Vec<::bytes::Bytes>> {
                self.inner.get_ranges(location, ranges).await
            }
        ]; $($rest)*);
    };
    (@pass [$($gen:tt)*] $ty:ty; [$($acc:tt)*]; delete_stream $($rest:ident)*) => {
        $crate::layer::object_store_wrapper!(@pass [$($gen)*] $ty; [$($acc)*
            fn delete_stream(
                &self,
                locations: ::futures::stream::BoxStream<
                    'static,
                    ::object_store::Result<::object_store::path::Path>,
                >,
            ) -> ::futures::stream::BoxStream<
                'static,
                ::object_store::Result<::object_store::path::Path>,
            > {
                self.inner.delete_stream(locations)
            }
        ]; $($rest)*);
    };
    (@pass [$($gen:tt)*] $ty:ty; [$($acc:tt)*]; list $($rest:ident)*) => {
        $crate::layer::object_store_wrapper!(@pass [$($gen)*] $ty; [$($acc)*
            fn list(
                &self,
                prefix: Option<&::object_store::path::Path>,
            ) -> ::futures::stream::BoxStream<
                'static,
                ::object_store::Result<::object_store::ObjectMeta>,
            > {
                self.inner.list(prefix)
            }
        ]; $($rest)*);
    };
    (@pass [$($gen:tt)*] $ty:ty; [$($acc:tt)*]; list_with_offset $($rest:ident)*) => {
        $crate::layer::object_store_wrapper!(@pass [$($gen)*] $ty; [$($acc)*
            fn list_with_offset(
                &self,
                prefix: Option<&::object_store::path::Path>,
                offset: &::object_store::path::Path,
            ) -> ::futures::stream::BoxStream<
                'static,
                ::object_store::Result<::object_store::ObjectMeta>,
            > {
                self.inner.list_with_offset(prefix, offset)
            }
        ]; $($rest)*);
    };
    (@pass [$($gen:tt)*] $ty:ty; [$($acc:tt)*]; list_with_delimiter $($rest:ident)*) => {
        $crate::layer::object_store_wrapper!(@pass [$($gen)*] $ty; [$($acc)*
            async fn list_with_delimiter(
                &self,
                prefix: Option<&::object_store::path::Path>,
            ) -> ::object_store::Result<::object_store::ListResult> {
                self.inner.list_with_delimiter(prefix).await
            }
        ]; $($rest)*);
    };
    (@pass [$($gen:tt)*] $ty:ty; [$($acc:tt)*]; copy_opts $($rest:ident)*) => {
        $crate::layer::object_store_wrapper!(@pass [$($gen)*] $ty; [$($acc)*
            async fn copy_opts(
                &self,
                from: &::object_store::path::Path,
                to: &::object_store::path::Path,
                options: ::object_store::CopyOptions,
            ) -> ::object_store::Result<()> {
                self.inner.copy_opts(from, to, options).await
            }
        ]; $($rest)*);
    };
    (@pass [$($gen:tt)*] $ty:ty; [$($acc:tt)*]; rename_opts $($rest:ident)*) => {
        $crate::layer::object_store_wrapper!(@pass [$($gen)*] $ty; [$($acc)*
            async fn rename_opts(
                &self,
                from: &::object_store::path::Path,
                to: &::object_store::path::Path,
                options: ::object_store::RenameOptions,
            ) -> ::object_store::Result<()> {
                self.inner.rename_opts(from, to, options).await
            }
        ]; $($rest)*);
    };
    (@pass [$($gen:tt)*] $ty:ty; [$($acc:tt)*];) => {
        #[::async_trait::async_trait]
        impl<$($gen)*> ::object_store::ObjectStore for $ty {
            $($acc)*
        }
    };
}
pub(crate) use object_store_wrapper;

/// What a wrapper does around a multipart upload of its inner store.
#[async_trait]
pub(crate) trait UploadHooks: Send + Sync + 'static {
    /// Before a part of `len` bytes goes to the inner upload; an error refuses the part.
    fn part(&self, len: u64) -> OsResult<()>;
    /// Before the inner upload completes; an error fails the completion.
    async fn complete(&self) -> OsResult<()> {
        Ok(())
    }
}

/// A multipart upload of an inner store with a wrapper's [`UploadHooks`].
pub(crate) struct HookedUpload<H> {
    pub(crate) inner: Box<dyn MultipartUpload>,
    pub(crate) hooks: H,
}

impl<H> std::fmt::Debug for HookedUpload<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CountingUpload")
    }
}

#[async_trait]
impl<H: UploadHooks> MultipartUpload for HookedUpload<H> {
    fn put_part(&mut self, data: PutPayload) -> UploadPart {
        match self.hooks.part(data.content_length() as u64) {
            Ok(()) => self.inner.put_part(data),
            Err(e) => Box::pin(async move { Err(e) }),
        }
    }
    async fn complete(&mut self) -> OsResult<PutResult> {
        self.hooks.complete().await?;
        self.inner.complete().await
    }
    async fn abort(&mut self) -> OsResult<()> {
        self.inner.abort().await
    }
}
