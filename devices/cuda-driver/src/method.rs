//! How a list of GPU copies moves: the copy kernel, the driver's batched
//! copy, or a copy each, and the setting that forces one (each CUDA plugin
//! has its own key: `cuda_ipc.copy`, `cuda.copy`).

use ferry_plugins_abi::sdk::{PluginError, PluginResult};
use ferry_plugins_abi::ErrorCode;

/// One way of moving a list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    /// The copy kernel: one launch for the list.
    Kernel,
    /// cuMemcpyBatchAsync: one call, one DMA per copy.
    Batch,
    /// One cuMemcpyAsync per copy.
    PerCopy,
}

impl Method {
    pub fn name(self) -> &'static str {
        match self {
            Method::Kernel => "kernel",
            Method::Batch => "batch",
            Method::PerCopy => "per-copy",
        }
    }
}

/// A plugin's copy setting (`cuda_ipc.copy`, `cuda.copy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CopySetting {
    /// The best this GPU and driver offer.
    #[default]
    Auto,
    Force(Method),
}

impl CopySetting {
    /// `auto|kernel|batch|per-copy`; absent or empty is auto. `key` names
    /// the setting in the error.
    pub fn parse(key: &str, value: Option<&str>) -> PluginResult<CopySetting> {
        Ok(match value.map(str::trim).unwrap_or("") {
            "" | "auto" => CopySetting::Auto,
            "kernel" => CopySetting::Force(Method::Kernel),
            "batch" => CopySetting::Force(Method::Batch),
            "per-copy" => CopySetting::Force(Method::PerCopy),
            other => {
                return Err(PluginError::new(
                    ErrorCode::InvalidArgument,
                    format!("{key}={other:?}: expected auto, kernel, batch or per-copy"),
                ))
            }
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            CopySetting::Auto => "auto",
            CopySetting::Force(m) => m.name(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_setting_takes_four_words() {
        let parse = |v| CopySetting::parse("cuda.copy", v);
        assert_eq!(parse(None).unwrap(), CopySetting::Auto);
        assert_eq!(parse(Some(" auto ")).unwrap(), CopySetting::Auto);
        assert_eq!(
            parse(Some("per-copy")).unwrap(),
            CopySetting::Force(Method::PerCopy)
        );
        let e = parse(Some("dma")).unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidArgument);
        assert!(
            e.message
                .contains("cuda.copy=\"dma\": expected auto, kernel, batch or per-copy"),
            "{}",
            e.message
        );
    }
}
