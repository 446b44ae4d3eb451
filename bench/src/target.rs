//! The `--target` specs shared by the binaries: one server or a pool of
//! instances, the processes whose CPU and memory count as the target's.

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use bytes::Bytes;

use crate::load::Endpoint;
use crate::{memory, procstat};

/// The `--target` syntax, for error messages.
pub const TARGET_SYNTAX: &str =
    "NAME=URL[|URL...][,pid=PID[+PID...]][,concurrency=N][,slow][,metrics]";

/// One target from `--target`: a single server, or a pool of instances
/// that is measured as one (its load spread round-robin over them).
#[derive(Debug, Clone)]
pub struct Target {
    pub name: String,
    /// The URL part of the spec as given (`URL1|URL2` for a pool).
    pub url: String,
    /// Where requests go: one instance, or several.
    pub instances: Vec<Instance>,
    /// The processes whose trees' CPU time is the target's, summed (empty:
    /// not measured).
    pub pids: Vec<u32>,
    pub concurrency: Option<usize>,
    /// Left out of the high-rate latency phase (see `--fast-rate`).
    pub slow: bool,
    /// Reports its own time per request at `/metrics` (canarygate).
    pub metrics: bool,
}

/// One server of a target.
#[derive(Debug, Clone)]
pub struct Instance {
    /// As given in the spec.
    pub url: String,
    pub addr: SocketAddr,
    /// `Host` header: the URL's `host:port`.
    pub host: String,
    /// Path of the chat endpoint, e.g. `/v1/chat/completions`.
    pub path: String,
}

impl Instance {
    /// An `http://` API base (`http://127.0.0.1:8080/v1`) or chat endpoint.
    pub fn parse(url: &str) -> Result<Self, String> {
        let without_scheme = url
            .strip_prefix("http://")
            .ok_or_else(|| format!("{url}: only http:// URLs"))?;
        let (host, base) = match without_scheme.find('/') {
            Some(index) => without_scheme.split_at(index),
            None => (without_scheme, ""),
        };
        let base = base.trim_end_matches('/');
        let path = if base.ends_with("/chat/completions") {
            base.to_owned()
        } else {
            format!("{base}/chat/completions")
        };
        let addr = host
            .to_socket_addrs()
            .map_err(|e| format!("{host}: {e}"))?
            .next()
            .ok_or_else(|| format!("{host} resolves to nothing"))?;
        Ok(Self {
            url: url.to_owned(),
            addr,
            host: host.to_owned(),
            path,
        })
    }
}

impl Target {
    /// Parses `NAME=URL[|URL...][,pid=PID[+PID...]][,concurrency=N][,slow][,metrics]`.
    /// Several URLs make a pool; several pids are summed (the pool's
    /// instances and any server they share).
    pub fn parse(spec: &str) -> Result<Self, String> {
        let (name, rest) = spec
            .split_once('=')
            .ok_or_else(|| format!("{spec}: expected {TARGET_SYNTAX}"))?;
        let mut parts = rest.split(',');
        let url = parts.next().unwrap_or_default().to_owned();
        let mut pids = Vec::new();
        let mut concurrency = None;
        let mut slow = false;
        let mut metrics = false;
        for part in parts {
            match (part, part.split_once('=')) {
                ("slow", _) => slow = true,
                ("metrics", _) => metrics = true,
                (_, Some(("pid", value))) => {
                    pids = value
                        .split('+')
                        .map(|pid| pid.parse().map_err(|e| format!("{spec}: pid {pid}: {e}")))
                        .collect::<Result<_, _>>()?
                }
                (_, Some(("concurrency", value))) => {
                    concurrency = Some(
                        value
                            .parse()
                            .map_err(|e| format!("{spec}: concurrency: {e}"))?,
                    )
                }
                _ => return Err(format!("{spec}: unknown option {part}")),
            }
        }
        let mut instances: Vec<Instance> = Vec::new();
        for one in url.split('|') {
            let instance = Instance::parse(one).map_err(|e| format!("{spec}: {e}"))?;
            if instances.iter().any(|other| other.addr == instance.addr) {
                return Err(format!("{spec}: {} is listed twice", instance.host));
            }
            instances.push(instance);
        }
        Ok(Self {
            name: name.to_owned(),
            url,
            instances,
            pids,
            concurrency,
            slow,
            metrics,
        })
    }

    /// Several instances, or several processes measured together.
    pub fn is_pool(&self) -> bool {
        self.instances.len() > 1 || self.pids.len() > 1
    }

    /// The pids as given: `42`, `42+43+7`, or `-`.
    pub fn pids_text(&self) -> String {
        if self.pids.is_empty() {
            return "-".to_owned();
        }
        let pids: Vec<String> = self.pids.iter().map(u32::to_string).collect();
        pids.join("+")
    }

    /// CPU time used so far by the target's process trees together (None
    /// without pids).
    pub fn cpu(&self) -> Option<Duration> {
        (!self.pids.is_empty()).then(|| procstat::trees_cpu(&self.pids))
    }

    /// One endpoint per instance, each sending `body` with `authorization`.
    pub fn endpoints(&self, body: &Bytes, authorization: &str, stream: bool) -> Vec<Endpoint> {
        self.instances
            .iter()
            .map(|instance| Endpoint {
                addr: instance.addr,
                host: instance.host.clone(),
                path: instance.path.clone(),
                authorization: authorization.to_owned(),
                body: body.clone(),
                stream,
            })
            .collect()
    }

    /// Resident memory of the target's process trees together, bytes (None
    /// without pids).
    pub fn rss(&self) -> Option<u64> {
        (!self.pids.is_empty()).then(|| memory::trees_rss(&self.pids))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse() {
        let t = Target::parse("nginx=http://127.0.0.1:8080/v1,pid=42,concurrency=8").unwrap();
        assert_eq!(t.name, "nginx");
        assert_eq!(t.url, "http://127.0.0.1:8080/v1");
        assert_eq!(t.instances.len(), 1);
        assert_eq!(t.instances[0].addr, "127.0.0.1:8080".parse().unwrap());
        assert_eq!(t.instances[0].host, "127.0.0.1:8080");
        assert_eq!(t.instances[0].path, "/v1/chat/completions");
        assert_eq!(t.pids, vec![42]);
        assert_eq!(t.pids_text(), "42");
        assert_eq!(t.concurrency, Some(8));
        assert!(!t.slow && !t.metrics && !t.is_pool());
        let t = Target::parse("cg=http://127.0.0.1:8081/v1,metrics,slow").unwrap();
        assert!(t.slow && t.metrics);
        let t = Target::parse("direct=http://127.0.0.1:9000/").unwrap();
        assert_eq!(t.instances[0].path, "/chat/completions");
        assert!(t.pids.is_empty());
        assert_eq!(t.pids_text(), "-");
        assert_eq!(t.cpu(), None);
        let t = Target::parse("x=http://127.0.0.1:1/v1/chat/completions").unwrap();
        assert_eq!(t.instances[0].path, "/v1/chat/completions");
        assert!(Target::parse("https=https://127.0.0.1:1/v1").is_err());
        assert!(Target::parse("no-url").is_err());
        assert!(Target::parse("x=http://127.0.0.1:1/v1,cpu=3").is_err());
        assert!(Target::parse("x=http://127.0.0.1:1/v1,pid=").is_err());
        assert!(Target::parse("x=http://127.0.0.1:1/v1,pid=-4").is_err());
    }

    #[test]
    fn pools_parse() {
        let t = Target::parse(
            "redis-pair=http://127.0.0.1:8081/v1|http://127.0.0.1:8082/v1,pid=11+12+7,metrics",
        )
        .unwrap();
        assert_eq!(t.name, "redis-pair");
        assert_eq!(t.url, "http://127.0.0.1:8081/v1|http://127.0.0.1:8082/v1");
        let hosts: Vec<&str> = t.instances.iter().map(|i| i.host.as_str()).collect();
        assert_eq!(hosts, ["127.0.0.1:8081", "127.0.0.1:8082"]);
        assert_eq!(t.instances[1].url, "http://127.0.0.1:8082/v1");
        assert!(t.instances.iter().all(|i| i.path == "/v1/chat/completions"));
        assert_eq!(t.pids, vec![11, 12, 7]);
        assert_eq!(t.pids_text(), "11+12+7");
        assert!(t.metrics && t.is_pool());
        // One endpoint per instance, in order, with the same request.
        let body = Bytes::from_static(b"{}");
        let endpoints = t.endpoints(&body, "Bearer sk-x", true);
        assert_eq!(endpoints.len(), 2);
        assert_eq!(endpoints[1].addr, "127.0.0.1:8082".parse().unwrap());
        assert_eq!(endpoints[1].host, "127.0.0.1:8082");
        assert_eq!(endpoints[0].body, endpoints[1].body);
        assert_eq!(endpoints[1].authorization, "Bearer sk-x");
        assert!(endpoints[1].stream);
        // Instances may differ in their path; one pid may stand for a pool.
        let t = Target::parse("p=http://127.0.0.1:1/v1|http://127.0.0.1:2/,pid=5").unwrap();
        assert_eq!(t.instances[1].path, "/chat/completions");
        assert!(t.is_pool());
        // Several processes for one server are a pool too (of processes).
        assert!(
            Target::parse("q=http://127.0.0.1:1,pid=1+2")
                .unwrap()
                .is_pool()
        );
        for bad in [
            "p=http://127.0.0.1:1/v1|",
            "p=|http://127.0.0.1:1/v1",
            "p=http://127.0.0.1:1/v1|https://127.0.0.1:2/v1",
            "p=http://127.0.0.1:1/v1|http://127.0.0.1:1/v1",
            "p=http://127.0.0.1:1/v1|http://127.0.0.1:1/",
            "p=http://127.0.0.1:1/v1,pid=1+",
            "p=http://127.0.0.1:1/v1,pid=1++2",
            "p=http://127.0.0.1:1/v1,pid=1|2",
        ] {
            assert!(Target::parse(bad).is_err(), "{bad} parsed");
        }
    }
}
