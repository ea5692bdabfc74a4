//! Which EC2 instance is calling: its instance identity document, signed
//! by AWS, checked against AWS's public key for the region.
//!
//! An instance reads its document and the document's signature from its
//! instance metadata (`/latest/dynamic/instance-identity/document` and
//! `/signature`: RSA PKCS#1 v1.5 over SHA-256, base64). Only that instance
//! can read them, so a verified document proves the caller's instance id
//! where a shared secret (the launch batch's token, in every sibling's user
//! data) could not. The signature is checked over the exact bytes received:
//! re-serialising the JSON would break it.
//!
//! AWS publishes one certificate per region; the standard (non opt-in)
//! regions share one 1024-bit RSA key, built in here
//! ([`IdentityKeys::aws_standard_regions`]). Opt-in regions, GovCloud and
//! China have keys of their own: give their certificates in the
//! `identity-certificates` environment setting. Only the public key matters
//! (AWS's own verification steps use `openssl x509 -pubkey`): the
//! certificates are self-signed and some have expired.

use crate::{Error, Result};
use aws_lc_rs::signature::{UnparsedPublicKey, RSA_PKCS1_1024_8192_SHA256_FOR_LEGACY_USE_ONLY};
use base64::Engine;

/// The most a document may be: AWS's are about 500 bytes.
pub const MAX_DOCUMENT_BYTES: usize = 4096;
/// The most a (base64) signature may be: a 4,096-bit RSA signature is 684
/// characters.
pub const MAX_SIGNATURE_CHARS: usize = 1024;

/// The public key (DER SubjectPublicKeyInfo, base64) of AWS's instance
/// identity certificate for the standard regions (us-east-1 and -2,
/// us-west-1 and -2, ca-central-1, sa-east-1, eu-west-1 to -3,
/// eu-central-1, eu-north-1, ap-south-1, ap-northeast-1 to -3,
/// ap-southeast-1 and -2), as AWS's "verify the instance identity
/// document" page publishes it.
const AWS_STANDARD_REGIONS_KEY: &str = "MIGfMA0GCSqGSIb3DQEBAQUAA4GNADCBiQKBgQCHvRjf/0kStpJ248khtIaN8qkDN3tkw4VjvA9nvPl2anJO+eIBUqPfQG09kZlwpWpmyO8bGB2RWqWxCwuB/dcnIob6w420k9WY5C0IIGtDRNauN3kuvGXkw3HEnF0EjYr0pcyWUvByWY4KswZV42X7Y7XSS13hOIcL6NLA+H94/QIDAQAB";

/// The public keys a controller trusts to have signed identity documents.
#[derive(Clone, PartialEq, Eq)]
pub struct IdentityKeys(Vec<Vec<u8>>);

impl std::fmt::Debug for IdentityKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "IdentityKeys({} key(s))", self.0.len())
    }
}

impl IdentityKeys {
    /// AWS's key for the standard regions.
    pub fn aws_standard_regions() -> IdentityKeys {
        let der = base64::engine::general_purpose::STANDARD
            .decode(AWS_STANDARD_REGIONS_KEY)
            .expect("a valid built-in key");
        IdentityKeys(vec![der])
    }

    /// The keys of the certificates in `pem` (one or more `CERTIFICATE`
    /// blocks), e.g. AWS's certificate for an opt-in region.
    pub fn from_pem(pem: &str) -> Result<IdentityKeys> {
        use rustls_pki_types::pem::PemObject;
        use rustls_pki_types::CertificateDer;
        let bad = |why: String| {
            Error::Config(format!(
                "`identity-certificates`: {why}; give the PEM certificates AWS publishes for the region's instance identity signature"
            ))
        };
        let mut keys = Vec::new();
        for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
            let cert = cert.map_err(|e| bad(format!("not PEM: {e}")))?;
            let parsed = webpki::EndEntityCert::try_from(&cert)
                .map_err(|e| bad(format!("not an X.509 v3 certificate: {e}")))?;
            keys.push(parsed.subject_public_key_info().as_ref().to_vec());
        }
        if keys.is_empty() {
            return Err(bad("no certificate found".into()));
        }
        Ok(IdentityKeys(keys))
    }

    /// These keys and `other`'s.
    pub fn and(mut self, other: IdentityKeys) -> IdentityKeys {
        self.0.extend(other.0);
        self
    }

    /// Checks `signature` (base64, as the metadata service gives it;
    /// whitespace ignored) over `document` with any of these keys, and
    /// reads the document. Refused: a document or signature beyond the
    /// bounds above, a signature no key made, a document that is not one.
    pub fn verify(&self, document: &[u8], signature: &str) -> Result<IdentityDocument> {
        let refused = |why: &str| Error::Identity(why.to_string());
        if document.len() > MAX_DOCUMENT_BYTES || signature.len() > MAX_SIGNATURE_CHARS {
            return Err(refused("identity document or signature too large"));
        }
        let compact: String = signature.chars().filter(|c| !c.is_whitespace()).collect();
        let sig = base64::engine::general_purpose::STANDARD
            .decode(compact)
            .map_err(|_| refused("the identity signature is not base64"))?;
        let signed = self.0.iter().any(|key| {
            UnparsedPublicKey::new(&RSA_PKCS1_1024_8192_SHA256_FOR_LEGACY_USE_ONLY, key)
                .verify(document, &sig)
                .is_ok()
        });
        if !signed {
            return Err(refused(
                "the identity document's signature is not from a trusted key",
            ));
        }
        serde_json::from_slice(document)
            .map_err(|_| refused("the signed identity document is not one"))
    }
}

/// What jujube reads of an instance identity document.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IdentityDocument {
    pub instance_id: String,
    pub region: String,
    pub account_id: String,
    #[serde(default)]
    pub private_ip: Option<String>,
    #[serde(default)]
    pub availability_zone: Option<String>,
    #[serde(default)]
    pub pending_time: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A document AWS signed (us-east-1, 2022), exactly as an instance's
    /// metadata service served it, with its signature.
    const AWS_DOCUMENT: &str = r#"{
  "accountId" : "628783029487",
  "architecture" : "x86_64",
  "availabilityZone" : "us-east-1b",
  "billingProducts" : null,
  "devpayProductCodes" : null,
  "marketplaceProductCodes" : null,
  "imageId" : "ami-0c02fb55956c7d316",
  "instanceId" : "i-076e9b91f7c420782",
  "instanceType" : "t2.micro",
  "kernelId" : null,
  "pendingTime" : "2022-03-25T20:07:16Z",
  "privateIp" : "172.31.84.238",
  "ramdiskId" : null,
  "region" : "us-east-1",
  "version" : "2017-09-30"
}"#;
    const AWS_SIGNATURE: &str = "M7rX9w1s5zK1V7hK0dsE4hTDXHHaaDuKQ9iIz/W8ZNaA2lJ/usz5YuX+ORt3luJwswl/+B7cYOkJbXRMx/pEQ6vT+niLGZDC9ZZ1h9Ox4h4e4m4IisQSCUrVIzyLj+MB27/Wyy0NhXcpoZVjNEmioxF2HNpOR4aCwUxxOm81y98=";

    /// AWS's us-east-1 certificate (2024 reissue) for the same key.
    const AWS_US_EAST_1_CERT: &str = "-----BEGIN CERTIFICATE-----
MIIDITCCAoqgAwIBAgIUE1y2NIKCU+Rg4uu4u32koG9QEYIwDQYJKoZIhvcNAQEL
BQAwXDELMAkGA1UEBhMCVVMxGTAXBgNVBAgTEFdhc2hpbmd0b24gU3RhdGUxEDAO
BgNVBAcTB1NlYXR0bGUxIDAeBgNVBAoTF0FtYXpvbiBXZWIgU2VydmljZXMgTExD
MB4XDTI0MDQyOTE3MzQwMVoXDTI5MDQyODE3MzQwMVowXDELMAkGA1UEBhMCVVMx
GTAXBgNVBAgTEFdhc2hpbmd0b24gU3RhdGUxEDAOBgNVBAcTB1NlYXR0bGUxIDAe
BgNVBAoTF0FtYXpvbiBXZWIgU2VydmljZXMgTExDMIGfMA0GCSqGSIb3DQEBAQUA
A4GNADCBiQKBgQCHvRjf/0kStpJ248khtIaN8qkDN3tkw4VjvA9nvPl2anJO+eIB
UqPfQG09kZlwpWpmyO8bGB2RWqWxCwuB/dcnIob6w420k9WY5C0IIGtDRNauN3ku
vGXkw3HEnF0EjYr0pcyWUvByWY4KswZV42X7Y7XSS13hOIcL6NLA+H94/QIDAQAB
o4HfMIHcMAsGA1UdDwQEAwIHgDAdBgNVHQ4EFgQUJdbMCBXKtvCcWdwUUizvtUF2
UTgwgZkGA1UdIwSBkTCBjoAUJdbMCBXKtvCcWdwUUizvtUF2UTihYKReMFwxCzAJ
BgNVBAYTAlVTMRkwFwYDVQQIExBXYXNoaW5ndG9uIFN0YXRlMRAwDgYDVQQHEwdT
ZWF0dGxlMSAwHgYDVQQKExdBbWF6b24gV2ViIFNlcnZpY2VzIExMQ4IUE1y2NIKC
U+Rg4uu4u32koG9QEYIwEgYDVR0TAQH/BAgwBgEB/wIBADANBgkqhkiG9w0BAQsF
AAOBgQAlxSmwcWnhT4uAeSinJuz+1BTcKhVSWb5jT8pYjQb8ZoZkXXRGb09mvYeU
NeqOBr27rvRAnaQ/9LUQf72+SahDFuS4CMI8nwowytqbmwquqFr4dxA/SDADyRiF
ea1UoMuNHTY49J/1vPomqsVn7mugTp+TbjqCfOJTpu0temHcFA==
-----END CERTIFICATE-----
";

    #[test]
    fn a_document_aws_signed_verifies_with_the_built_in_key() {
        let doc = IdentityKeys::aws_standard_regions()
            .verify(AWS_DOCUMENT.as_bytes(), AWS_SIGNATURE)
            .unwrap();
        assert_eq!(doc.instance_id, "i-076e9b91f7c420782");
        assert_eq!(doc.region, "us-east-1");
        assert_eq!(doc.private_ip.as_deref(), Some("172.31.84.238"));
    }

    #[test]
    fn the_built_in_key_is_the_published_certificates() {
        assert_eq!(
            IdentityKeys::from_pem(AWS_US_EAST_1_CERT).unwrap(),
            IdentityKeys::aws_standard_regions()
        );
    }

    #[test]
    fn a_changed_document_or_an_untrusted_key_is_refused() {
        let keys = IdentityKeys::aws_standard_regions();
        let forged = AWS_DOCUMENT.replace("i-076e9b91f7c420782", "i-076e9b91f7c420783");
        let e = keys.verify(forged.as_bytes(), AWS_SIGNATURE).unwrap_err();
        assert!(matches!(e, Error::Identity(_)), "{e}");
        // Re-serialised (the same JSON, other bytes): refused too.
        let v: serde_json::Value = serde_json::from_str(AWS_DOCUMENT).unwrap();
        let e = keys
            .verify(serde_json::to_string(&v).unwrap().as_bytes(), AWS_SIGNATURE)
            .unwrap_err();
        assert!(matches!(e, Error::Identity(_)), "{e}");
        // A key of our own signs a document for any instance: trusted only
        // when configured.
        let kp = rcgen::KeyPair::generate_for(&rcgen::PKCS_RSA_SHA256).unwrap();
        let cert = rcgen::CertificateParams::new(vec![])
            .unwrap()
            .self_signed(&kp)
            .unwrap()
            .pem();
        let sig = base64::engine::general_purpose::STANDARD
            .encode(rcgen::SigningKey::sign(&kp, forged.as_bytes()).unwrap());
        assert!(matches!(
            keys.verify(forged.as_bytes(), &sig),
            Err(Error::Identity(_))
        ));
        let trusting = keys.and(IdentityKeys::from_pem(&cert).unwrap());
        assert_eq!(
            trusting
                .verify(forged.as_bytes(), &sig)
                .unwrap()
                .instance_id,
            "i-076e9b91f7c420783"
        );
        // Beyond the bounds, or not base64: refused before any work.
        let big = vec![b' '; MAX_DOCUMENT_BYTES + 1];
        assert!(trusting.verify(&big, &sig).is_err());
        assert!(trusting.verify(forged.as_bytes(), "not base64!").is_err());
        assert!(IdentityKeys::from_pem("no certificate").is_err());
    }
}
