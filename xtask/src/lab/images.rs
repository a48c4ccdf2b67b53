//! The images the lab's kubelet stand-in knows: `<lab dir>/images.json`.
//!
//! The lab has no container runtime and pulls nothing. An "image" is a name
//! for programs on this machine: a Pod whose containers all use images listed
//! here is run (see [`super::kubelet`]); a Pod using any other image stays
//! Pending, its container waiting with reason `ErrImageNeverPull`.
//!
//! The file, as `lab deploy` (or a test) writes it:
//!
//! ```json
//! {"images": {"ghcr.io/egressgw/egressgw:0.1.0": {
//!     "entrypoint": ["/abs/path/to/egressgw"],
//!     "binaries": {"/usr/local/bin/egressgw": "/abs/path/to/egressgw"}}}}
//! ```
//!
//! A container's `command[0]` is looked up in `binaries` (an absolute path as
//! it is, a bare name in the usual `PATH` directories); without `command`,
//! `entrypoint` is the command. `args` are appended. Image references match
//! exactly as written in the Pod spec.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail, ensure};
use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};

use super::state::Paths;

/// The file name in the lab directory.
pub const FILE: &str = "images.json";

/// Where a bare command name is searched, in order: the `PATH` of a
/// typical image.
const SEARCH_PATH: [&str; 6] = [
    "/usr/local/sbin",
    "/usr/local/bin",
    "/usr/sbin",
    "/usr/bin",
    "/sbin",
    "/bin",
];

/// Every image the lab can run, by reference.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KnownImages {
    pub images: BTreeMap<String, Image>,
}

/// One image: its entrypoint and the programs it contains.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Image {
    /// The command when a container gives none: a program on this machine
    /// (absolute path), then fixed arguments.
    #[serde(default)]
    pub entrypoint: Vec<String>,
    /// Programs in the image: path inside the image -> path on this machine.
    #[serde(default)]
    pub binaries: BTreeMap<String, PathBuf>,
}

impl Image {
    /// An image whose entrypoint is `binary`, which it also holds at `at`
    /// (e.g. `/usr/local/bin/egressgw`).
    pub fn of_binary(binary: &Path, at: &str) -> Self {
        Self {
            entrypoint: vec![binary.display().to_string()],
            binaries: BTreeMap::from([(at.to_owned(), binary.to_path_buf())]),
        }
    }

    /// The program and arguments for a container with `command` and `args`
    /// (as in the Pod spec, variables already expanded).
    pub fn argv(&self, command: &[String], args: &[String]) -> anyhow::Result<Vec<String>> {
        let mut argv = match command.split_first() {
            Some((program, rest)) => {
                let found = self.binary(program)?;
                let mut argv = vec![found.display().to_string()];
                argv.extend(rest.iter().cloned());
                argv
            }
            None => {
                ensure!(
                    !self.entrypoint.is_empty(),
                    "the container has no command and the image has no entrypoint"
                );
                self.entrypoint.clone()
            }
        };
        argv.extend(args.iter().cloned());
        Ok(argv)
    }

    /// The program on this machine for `program` as the image knows it.
    fn binary(&self, program: &str) -> anyhow::Result<&Path> {
        let found = if program.contains('/') {
            self.binaries.get(program)
        } else {
            SEARCH_PATH
                .iter()
                .find_map(|dir| self.binaries.get(&format!("{dir}/{program}")))
        };
        match found {
            Some(path) => Ok(path),
            None => {
                let known: Vec<&str> = self.binaries.keys().map(String::as_str).collect();
                bail!(
                    "{program:?} is not in the image (it holds: {})",
                    if known.is_empty() {
                        "nothing".to_owned()
                    } else {
                        known.join(", ")
                    }
                )
            }
        }
    }

    fn validate(&self, reference: &str) -> anyhow::Result<()> {
        ensure!(
            self.entrypoint.is_empty() || Path::new(&self.entrypoint[0]).is_absolute(),
            "image {reference:?}: the entrypoint's program must be an absolute path, not {:?}",
            self.entrypoint[0]
        );
        for (inside, outside) in &self.binaries {
            ensure!(
                inside.starts_with('/') && outside.is_absolute(),
                "image {reference:?}: binaries map absolute paths to absolute paths, not {inside:?} -> {}",
                outside.display()
            );
        }
        Ok(())
    }
}

impl KnownImages {
    pub fn path(paths: &Paths) -> PathBuf {
        paths.lab.join(FILE)
    }

    /// The images of the lab of `paths`; none if the file does not exist.
    pub fn load(paths: &Paths) -> anyhow::Result<Self> {
        Self::load_from(&Self::path(paths))
    }

    pub fn load_from(path: &Path) -> anyhow::Result<Self> {
        let text = match fs::read_to_string(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            other => other.with_context(|| format!("reading {}", path.display()))?,
        };
        let images: Self =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        for (reference, image) in &images.images {
            image
                .validate(reference)
                .with_context(|| format!("in {}", path.display()))?;
        }
        Ok(images)
    }

    /// Writes the file whole (a new file renamed into place, so a reader
    /// never sees half of it).
    pub fn save(&self, paths: &Paths) -> anyhow::Result<()> {
        self.save_to(&Self::path(paths))
    }

    pub fn save_to(&self, path: &Path) -> anyhow::Result<()> {
        for (reference, image) in &self.images {
            image.validate(reference)?;
        }
        let mut text = serde_json::to_string_pretty(self).context("serializing images.json")?;
        text.push('\n');
        let tmp = path.with_extension("json.new");
        fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
        fs::rename(&tmp, path).with_context(|| format!("moving {} into place", path.display()))
    }

    /// Adds (or replaces) one image in the lab's file.
    pub fn register(paths: &Paths, reference: &str, image: Image) -> anyhow::Result<()> {
        Self::update(paths, |images| {
            images.images.insert(reference.to_owned(), image);
        })
    }

    /// Removes one image from the lab's file; no error if it was not there.
    pub fn unregister(paths: &Paths, reference: &str) -> anyhow::Result<()> {
        Self::update(paths, |images| {
            images.images.remove(reference);
        })
    }

    /// Reads, changes and writes the lab's file while holding an exclusive
    /// lock on the lab directory, so two writers (`lab deploy` and a test,
    /// say) never lose each other's images.
    pub fn update(paths: &Paths, change: impl FnOnce(&mut Self)) -> anyhow::Result<()> {
        let dir = File::open(&paths.lab)
            .with_context(|| format!("opening {} (is the lab up?)", paths.lab.display()))?;
        let _lock = Flock::lock(dir, FlockArg::LockExclusive)
            .map_err(|(_, e)| e)
            .with_context(|| format!("locking {}", paths.lab.display()))?;
        let mut images = Self::load(paths)?;
        let before = images.clone();
        change(&mut images);
        if images == before {
            return Ok(());
        }
        images.save(paths)
    }

    pub fn get(&self, reference: &str) -> Option<&Image> {
        self.images.get(reference)
    }
}

/// `lab image add|remove|list`.
#[derive(Debug, clap::Subcommand)]
pub enum ImageCommand {
    /// Make an image known: Pods using REFERENCE run BINARY.
    Add {
        reference: String,
        /// The program on this machine the image runs.
        #[arg(long)]
        binary: PathBuf,
        /// Where the image holds it.
        #[arg(long, default_value = "/usr/local/bin/app")]
        at: String,
    },
    /// Forget an image.
    Remove { reference: String },
    /// List the known images.
    List,
}

pub fn image(command: &ImageCommand, paths: &Paths) -> anyhow::Result<()> {
    match command {
        ImageCommand::Add {
            reference,
            binary,
            at,
        } => {
            let binary = fs::canonicalize(binary)
                .with_context(|| format!("no program at {}", binary.display()))?;
            KnownImages::register(paths, reference, Image::of_binary(&binary, at))?;
            println!("image {reference}: {} as {at}", binary.display());
        }
        ImageCommand::Remove { reference } => KnownImages::unregister(paths, reference)?,
        ImageCommand::List => {
            for (reference, image) in KnownImages::load(paths)?.images {
                println!("{reference}: entrypoint {:?}", image.entrypoint);
                for (inside, outside) in image.binaries {
                    println!("    {inside} -> {}", outside.display());
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(words: &[&str]) -> Vec<String> {
        words.iter().map(|w| (*w).to_owned()).collect()
    }

    fn egressgw() -> Image {
        Image::of_binary(Path::new("/lab/egressgw"), "/usr/local/bin/egressgw")
    }

    #[test]
    fn the_contract_reads_as_documented() {
        let text = r#"{"images": {"ghcr.io/egressgw/egressgw:0.1.0": {
            "entrypoint": ["/abs/egressgw"],
            "binaries": {"/usr/local/bin/egressgw": "/abs/egressgw"}}}}"#;
        let images: KnownImages = serde_json::from_str(text).unwrap();
        let image = images.get("ghcr.io/egressgw/egressgw:0.1.0").unwrap();
        assert_eq!(image.entrypoint, ["/abs/egressgw"]);
        assert_eq!(
            image.binaries["/usr/local/bin/egressgw"],
            Path::new("/abs/egressgw")
        );
    }

    #[test]
    fn a_misspelled_field_is_refused() {
        let text = r#"{"images": {"x": {"entrypiont": ["/a"]}}}"#;
        assert!(serde_json::from_str::<KnownImages>(text).is_err());
    }

    #[test]
    fn without_a_command_the_entrypoint_runs_with_the_args() {
        let argv = egressgw().argv(&[], &strings(&["agent", "--node", "n1"]));
        assert_eq!(
            argv.unwrap(),
            strings(&["/lab/egressgw", "agent", "--node", "n1"])
        );
    }

    #[test]
    fn a_command_is_looked_up_in_the_images_binaries() {
        let image = egressgw();
        let by_path = image.argv(
            &strings(&["/usr/local/bin/egressgw", "agent"]),
            &strings(&["-v"]),
        );
        assert_eq!(by_path.unwrap(), strings(&["/lab/egressgw", "agent", "-v"]));
        let by_name = image.argv(&strings(&["egressgw"]), &[]);
        assert_eq!(by_name.unwrap(), strings(&["/lab/egressgw"]));
    }

    #[test]
    fn a_command_the_image_does_not_hold_names_what_it_holds() {
        let err = egressgw()
            .argv(&strings(&["/bin/sh", "-c", "true"]), &[])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"/bin/sh\"") && err.contains("/usr/local/bin/egressgw"),
            "{err}"
        );
    }

    #[test]
    fn registering_keeps_the_images_already_there() {
        let dir = std::env::temp_dir().join(format!("egressgw-images-test-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let paths = Paths {
            prefix: crate::lab::topology::Prefix::new("egt").unwrap(),
            cache: dir.clone(),
            lab: dir.clone(),
        };
        assert!(KnownImages::load(&paths).unwrap().images.is_empty());
        KnownImages::register(&paths, "a:1", egressgw()).unwrap();
        KnownImages::register(&paths, "b:1", egressgw()).unwrap();
        KnownImages::unregister(&paths, "a:1").unwrap();
        KnownImages::unregister(&paths, "never:1").unwrap();
        let images = KnownImages::load(&paths).unwrap();
        assert_eq!(images.images.keys().collect::<Vec<_>>(), ["b:1"]);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn relative_paths_are_refused() {
        let image = Image {
            entrypoint: strings(&["egressgw"]),
            binaries: BTreeMap::new(),
        };
        assert!(image.validate("x").is_err());
        assert!(egressgw().validate("x").is_ok());
    }
}
