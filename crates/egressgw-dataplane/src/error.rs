//! The crate's error type.

use std::net::IpAddr;

use crate::ops::{Cause, Failed};

/// What went wrong talking to the kernel. Every variant names the object it
/// concerns.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A netlink request failed.
    #[error("{what}: {source}")]
    Netlink {
        /// The object and the request, e.g. `link egress.vxlan: set mtu`.
        what: String,
        /// The kernel's answer.
        #[source]
        source: rtnetlink::Error,
    },
    /// A generic-netlink (ethtool) request failed.
    #[error("{what}: {message}")]
    Ethtool {
        /// The device and the request.
        what: String,
        /// What the kernel or the decoder said.
        message: String,
    },
    /// An nftables transaction or listing failed.
    #[error("nftables: {what}: {message}")]
    Nft {
        /// The object or transaction.
        what: String,
        /// What `nft` said.
        message: String,
    },
    /// Announcing an EIP (gratuitous ARP / unsolicited NA) failed.
    #[error("announce {ip} on {ifname}: {message}")]
    Announce {
        /// The EIP.
        ip: IpAddr,
        /// The interface it was sent on.
        ifname: String,
        /// What failed.
        message: String,
    },
    /// Reading or writing a sysctl failed.
    #[error("sysctl {path}: {source}")]
    Sysctl {
        /// The file under `/proc/sys`.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The host lacks something the desired state needs.
    #[error("{0}")]
    Host(String),
}

impl Error {
    /// What went wrong, without the object (for reports that name the
    /// object beside it).
    pub fn detail(&self) -> String {
        match self {
            Error::Netlink {
                source: rtnetlink::Error::NetlinkError(m),
                ..
            } => m.to_io().to_string(),
            Error::Netlink { source, .. } => source.to_string(),
            Error::Ethtool { message, .. } | Error::Nft { message, .. } => message.clone(),
            Error::Announce { message, .. } => message.clone(),
            Error::Sysctl { source, .. } => source.to_string(),
            Error::Host(message) => message.clone(),
        }
    }
}

impl Error {
    /// Why it failed, as far as the kernel's answer tells.
    pub fn cause(&self) -> Cause {
        match self {
            Error::Netlink {
                source: rtnetlink::Error::NetlinkError(m),
                ..
            } => Cause::of_io(&m.to_io()),
            Error::Sysctl { source, .. } => Cause::of_io(source),
            other => Cause::of_message(&other.detail()),
        }
    }
}

impl Failed for Error {
    fn message(&self) -> String {
        self.detail()
    }

    fn cause(&self) -> Cause {
        Error::cause(self)
    }
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
