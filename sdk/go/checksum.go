package cbserve

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"

	"google.golang.org/grpc/codes"
)

// ChecksumAlgorithm names the digest Admin.WeightsChecksum and ChecksumOf compute.
//
// "cbserve-wsum-v1" depends on a tensor's bytes, shape and dtype alone, so equal tensors give
// equal digests on any device. A tensor's bytes (C order, little-endian, zero-padded to a
// multiple of 4) are read as 32-bit words w_i; with q_i = i * 0x9E3779B1 + 0x243F6A88 and
// h_i = fmix32(w_i XOR q_i) (mod 2^32, i taken mod 2^32; fmix32 is MurmurHash3's finaliser), two
// lanes sum int32(h_i) and int32(h_i * (q_i OR 1)), mod 2^64; the tensor's digest is the hex
// SHA-256 of "{dtype}:{shape, comma-separated}:{bytes}:" followed by the two lanes as 8-byte
// little-endian integers; the model's is the hex SHA-256 of the lines "{name}\t{digest}\n" in
// name order.
const ChecksumAlgorithm = "cbserve-wsum-v1"

const (
	positionMultiplier = 0x9E3779B1
	positionOffset     = 0x243F6A88
)

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
	var lanes [2]uint64
	var word [4]byte
	for start := 0; start < len(t.Data); start += 4 {
		clear(word[:])
		copy(word[:], t.Data[start:])
		w := binary.LittleEndian.Uint32(word[:])
		q := uint32(start/4)*positionMultiplier + positionOffset // the word's index, mod 2^32
		h := fmix32(w ^ q)
		lanes[0] += uint64(int64(int32(h)))
		lanes[1] += uint64(int64(int32(h * (q | 1))))
	}
	shape := make([]string, len(t.Shape))
	for i, dim := range t.Shape {
		shape[i] = strconv.FormatInt(dim, 10)
	}
	hash := sha256.New()
	fmt.Fprintf(hash, "%s:%s:%d:", t.DType, strings.Join(shape, ","), len(t.Data))
	var lane [8]byte
	for _, sum := range lanes {
		binary.LittleEndian.PutUint64(lane[:], sum)
		hash.Write(lane[:])
	}
	return hex.EncodeToString(hash.Sum(nil)), nil
}

func fmix32(h uint32) uint32 {
	h ^= h >> 16
	h *= 0x85EBCA6B
	h ^= h >> 13
	h *= 0xC2B2AE35
	return h ^ h>>16
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
	hash := sha256.New()
	for _, name := range names {
		fmt.Fprintf(hash, "%s\t%s\n", name, tensors[name].Digest)
	}
	return hex.EncodeToString(hash.Sum(nil))
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
