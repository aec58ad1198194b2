package cbserve

import (
	"context"
	"encoding/hex"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/zeebo/xxh3"
	"google.golang.org/grpc/codes"
)

// ChecksumAlgorithm names the digest Admin.WeightsChecksum and ChecksumOf compute, and starts
// every digest string ("xxh3-128:" and 32 hex digits), so a digest of another algorithm never
// compares equal by accident.
//
// "xxh3-128" depends on a tensor's bytes, shape and dtype alone, so equal tensors give equal
// digests on any device: a tensor's digest is the lowercase hex (canonical, big-endian) of
// XXH3-128, seed 0, of "{dtype}:{shape, comma-separated}:{bytes}:" followed by the tensor's bytes
// (C order, little-endian); the model's is the same of the lines "{name}\t{digest}\n" in name
// order. The server and the Python SDK define it in cbserve_checksum; the three SDKs check the
// same vectors (tests/data/weights_checksum_vectors.json).
const ChecksumAlgorithm = "xxh3-128"

// TensorChecksum is the digest of one tensor: its name in the model's state dict, the dtype it
// is held in (as safetensors names it: "F32", "BF16", ...) and its (whole) shape.
type TensorChecksum struct {
	Name   string
	Digest string
	DType  string
	Shape  []int64
}

// WeightsChecksum is a digest of a model's weights: of them all (Digest), and of each tensor by
// name when asked for (Tensors; empty otherwise). WeightVersion is the server's version of the
// weights it is of (0 from ChecksumOf).
type WeightsChecksum struct {
	Digest        string
	Algorithm     string
	WeightVersion uint64
	NumTensors    int
	Tensors       map[string]TensorChecksum
}

// TensorDigest returns the digest of one tensor as the server computes it of a tensor of the
// same dtype, shape and bytes (ChecksumAlgorithm). It fails with ErrInvalidArgument as
// UpdateWeights does for a tensor that cannot be sent.
func TensorDigest(t Tensor) (string, error) {
	if err := t.check(); err != nil {
		return "", err
	}
	shape := make([]string, len(t.Shape))
	for i, dim := range t.Shape {
		shape[i] = strconv.FormatInt(dim, 10)
	}
	hash := xxh3.New128()
	fmt.Fprintf(hash, "%s:%s:%d:", t.DType, strings.Join(shape, ","), len(t.Data))
	hash.Write(t.Data)
	return prefixedDigest(hash), nil
}

func prefixedDigest(hash *xxh3.Hasher128) string {
	sum := hash.Sum128().Bytes()
	return ChecksumAlgorithm + ":" + hex.EncodeToString(sum[:])
}

// ChecksumOf returns the digest of each tensor and of them all, as a server holding exactly these
// tensors reports it (Admin.WeightsChecksum with perTensor): a trainer's check of what it pushed.
// Give every tensor of the model's state dict, in the dtype the server holds it in, to compare
// the whole-model digest.
func ChecksumOf(tensors []Tensor) (*WeightsChecksum, error) {
	checksum := &WeightsChecksum{Algorithm: ChecksumAlgorithm, Tensors: make(map[string]TensorChecksum, len(tensors))}
	for _, t := range tensors {
		if _, seen := checksum.Tensors[t.Name]; seen {
			return nil, newError(codes.InvalidArgument, "tensor %q is given twice", t.Name)
		}
		digest, err := TensorDigest(t)
		if err != nil {
			return nil, err
		}
		checksum.Tensors[t.Name] = TensorChecksum{Name: t.Name, Digest: digest, DType: t.DType, Shape: slices.Clone(t.Shape)}
	}
	checksum.NumTensors = len(checksum.Tensors)
	checksum.Digest = combinedDigest(checksum.Tensors)
	return checksum, nil
}

func combinedDigest(tensors map[string]TensorChecksum) string {
	names := make([]string, 0, len(tensors))
	for name := range tensors {
		names = append(names, name)
	}
	slices.Sort(names)
	hash := xxh3.New128()
	for _, name := range names {
		fmt.Fprintf(hash, "%s\t%s\n", name, tensors[name].Digest)
	}
	return prefixedDigest(hash)
}

// WeightsMismatchError is CheckWeights' error when replicas hold other weights than the
// reference: the expected checksum, or else the first replica's.
type WeightsMismatchError struct {
	// Reference is "expected", or the target of the replica the others were compared with.
	Reference string
	// Checksums holds each replica's checksum, by target.
	Checksums map[string]*WeightsChecksum
	// Differing holds, for each replica that differs, the names of the tensors whose digests
	// differ from the reference's (names held by one side only included), in name order.
	Differing map[string][]string
}

func (e *WeightsMismatchError) Error() string {
	targets := make([]string, 0, len(e.Differing))
	for target := range e.Differing {
		targets = append(targets, target)
	}
	slices.Sort(targets)
	const shown = 5
	parts := make([]string, 0, len(targets))
	for _, target := range targets {
		names := e.Differing[target]
		listed := strings.Join(names[:min(len(names), shown)], ", ")
		if len(names) > shown {
			listed += fmt.Sprintf(" and %d more", len(names)-shown)
		}
		parts = append(parts, fmt.Sprintf("%s (weight_version %d) in %d tensors: %s",
			target, e.Checksums[target].WeightVersion, len(names), listed))
	}
	against := e.Reference
	if against == "expected" {
		against = "the expected weights"
	}
	return fmt.Sprintf("cbserve: %d of %d replicas hold other weights than %s: %s",
		len(targets), len(e.Checksums), against, strings.Join(parts, "; "))
}

// CheckWeights checks in one call that every replica holds the same weights (slime's
// check_weights after a sync): each computes its checksum with per-tensor digests, in parallel,
// and each is compared with expected (a trainer's own, from ChecksumOf), or when expected is nil
// with the first replica's. It returns the common checksum, a *WeightsMismatchError naming every
// replica that differs and the tensors it differs in, or the first replica's call error.
func CheckWeights(ctx context.Context, expected *WeightsChecksum, replicas ...*Admin) (*WeightsChecksum, error) {
	if len(replicas) == 0 {
		return nil, newError(codes.InvalidArgument, "CheckWeights needs at least one replica")
	}
	checksums := make([]*WeightsChecksum, len(replicas))
	errs := make([]error, len(replicas))
	var wg sync.WaitGroup
	for i, replica := range replicas {
		wg.Go(func() { checksums[i], errs[i] = replica.WeightsChecksum(ctx, true) })
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			return nil, fmt.Errorf("%s: %w", replicas[i].Target(), err)
		}
	}
	reference, referenceName := expected, "expected"
	if reference == nil {
		reference, referenceName = checksums[0], replicas[0].Target()
	}
	mismatch := &WeightsMismatchError{Reference: referenceName, Checksums: map[string]*WeightsChecksum{}, Differing: map[string][]string{}}
	for i, checksum := range checksums {
		target := replicas[i].Target()
		mismatch.Checksums[target] = checksum
		if checksum.Algorithm != reference.Algorithm || checksum.Digest != reference.Digest {
			mismatch.Differing[target] = differingTensors(reference, checksum)
		}
	}
	if len(mismatch.Differing) > 0 {
		return nil, mismatch
	}
	return reference, nil
}

func differingTensors(reference, checksum *WeightsChecksum) []string {
	var names []string
	for name, tensor := range reference.Tensors {
		if other, ok := checksum.Tensors[name]; !ok || other.Digest != tensor.Digest || reference.Algorithm != checksum.Algorithm {
			names = append(names, name)
		}
	}
	for name := range checksum.Tensors {
		if _, ok := reference.Tensors[name]; !ok {
			names = append(names, name)
		}
	}
	slices.Sort(names)
	return names
}
