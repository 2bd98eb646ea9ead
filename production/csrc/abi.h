// Generated from reference/abi.py (render_header) by production/_build.py: do not
// edit by hand. The interface between Python and the kernels; tests/reference/
// test_abi.py fails if this file drifts from reference/abi.py.
#pragma once

#include <cstdint>

namespace epkit {

// reasons (reference/errors.py Reason): reason::kIndexOutOfRange, ...
namespace reason {
constexpr int64_t kOk = 0;
constexpr int64_t kIndexOutOfRange = 1;
constexpr int64_t kDuplicateExpert = 2;
constexpr int64_t kIndexDtype = 3;
constexpr int64_t kXNot2d = 4;
constexpr int64_t kIdxShape = 5;
constexpr int64_t kWeightsShape = 6;
constexpr int64_t kHiddenMismatch = 7;
constexpr int64_t kDtypeMismatch = 8;
constexpr int64_t kTopkMismatch = 9;
constexpr int64_t kExpertsNotDivisible = 10;
constexpr int64_t kAlign = 11;
constexpr int64_t kCapacity = 12;
constexpr int64_t kNonfiniteWeight = 13;
constexpr int64_t kNonfinitePayload = 14;
constexpr int64_t kHiddenNotMult32 = 15;
constexpr int64_t kExpertYRows = 16;
constexpr int64_t kExpertYHidden = 17;
constexpr int64_t kXDtype = 18;
constexpr int64_t kWeightsDtype = 19;
constexpr int64_t kStaticOverflow = 20;
constexpr int64_t kEqualNonuniform = 21;
constexpr int64_t kNumExperts = 22;
constexpr int64_t kExpertYDtype = 23;
constexpr int64_t kOption = 24;
constexpr int64_t kIdxNot2d = 25;
constexpr int64_t kWeightsNot2d = 26;
constexpr int64_t kGradRows = 27;
constexpr int64_t kGradHidden = 28;
constexpr int64_t kGradDtype = 29;
constexpr int64_t kStaticMax = 30;
constexpr int64_t kRowsDtypeMismatch = 31;
constexpr int64_t kTopkTooLarge = 32;
constexpr int64_t kNotATensor = 33;
constexpr int64_t kDevice = 34;
constexpr int64_t kCallMismatch = 35;
constexpr int64_t kCallSequence = 36;
constexpr int64_t kNumExpertsMismatch = 37;
constexpr int64_t kAlignMismatch = 38;
constexpr int64_t kCapacityMismatch = 39;
constexpr int64_t kTransportMismatch = 40;
constexpr int64_t kExchangeMismatch = 41;
constexpr int64_t kPayloadMismatch = 42;
constexpr int64_t kMaxTokensMismatch = 43;
constexpr int64_t kDispatchMismatch = 44;
constexpr int64_t kForeignDispatch = 45;
constexpr int64_t kTooManyLocalExperts = 46;
constexpr int64_t kSendCounts = 47;
constexpr int64_t kSendCountsSum = 48;
constexpr int64_t kSendCountsNegative = 49;
constexpr int64_t kRowWidthMismatch = 50;
constexpr int64_t kCapacityFactor = 51;
constexpr int64_t kCapacityAndFactor = 52;
constexpr int64_t kCapacityFactorMismatch = 53;
constexpr int64_t kCallFlagsMismatch = 54;
constexpr int64_t kBadArgument = 55;
constexpr int64_t kBadGroup = 56;
constexpr int64_t kRanksPerNode = 57;
constexpr int64_t kRanksPerNodeMismatch = 58;
constexpr int64_t kUnsupported = 59;
}  // namespace reason

// dtype codes (reference/errors.py DTYPE_CODES)
namespace dtype_code {
constexpr int64_t kFloat32 = 1;
constexpr int64_t kBfloat16 = 2;
constexpr int64_t kFloat16 = 3;
constexpr int64_t kFloat64 = 4;
constexpr int64_t kInt8 = 5;
constexpr int64_t kInt16 = 6;
constexpr int64_t kInt32 = 7;
constexpr int64_t kInt64 = 8;
constexpr int64_t kUint8 = 9;
constexpr int64_t kBool = 10;
constexpr int64_t kFloat8E4m3fn = 11;
constexpr int64_t kUint16 = 12;
constexpr int64_t kUint32 = 13;
constexpr int64_t kUint64 = 14;
constexpr int64_t kFloat8E5m2 = 15;
constexpr int64_t kComplex64 = 16;
constexpr int64_t kComplex128 = 17;
constexpr int64_t kFloat8E8m0fnu = 18;
}  // namespace dtype_code

// options
constexpr int64_t kPairs = 0;
constexpr int64_t kDedup = 1;
constexpr int64_t kHier = 2;
enum Requested : int64_t { kReqRagged = 0, kReqPadded = 1, kReqEqual = 2, kReqAuto = 3, kReqLazy = 4, kReqStatic = 5 };
enum Variant : int64_t { kRagged = 0, kPadded = 1, kEqual = 2, kStatic = 3 };
constexpr int64_t kPayloadNone = 0;
constexpr int64_t kPayloadMxfp8 = 1;
constexpr int64_t kPayloadFp8Block128 = 2;
constexpr int64_t kPayloadCount = 3;
constexpr int64_t kPayloadBlocks[kPayloadCount] = {0, 32, 128};
constexpr int64_t kPayloadScaleBytes[kPayloadCount] = {0, 1, 4};
constexpr const char* kPayloadChoices = "0 (none), 1 (mxfp8), 2 (fp8_block128)";

// count words: [header | tokens_per_expert (E) | tokens_per_rank (R)]
enum WordField : int64_t { kWordErrorCode = 0, kWordErrorA = 1, kWordErrorB = 2, kWordTokens = 3, kWordHidden = 4, kWordTopK = 5, kWordXDtype = 6, kWordPayload = 7 };
constexpr int64_t kWordHeader = 8;

// prepare's pre_error argument
enum PreErrorField : int64_t { kPreErrorCode = 0, kPreErrorA = 1, kPreErrorB = 2, kPreErrorXDtype = 3, kPreErrorMaxTokens = 4 };

// plan header words, then the sections (PlanOffsets in epkit.h)
enum PlanHeader : int64_t { kErrCode = 0, kErrA = 1, kErrB = 2, kErrRank = 3, kSendRows = 4, kRecvRows = 5, kExpertRows = 6, kUniform = 7, kMaxChunk = 8, kRanks = 9, kLocalExperts = 10, kExperts = 11, kTransport = 12, kCapacity = 13, kAlign = 14, kTopK = 15, kStaticCap = 16, kVariant = 17, kPayloadBytes = 18, kTokCap = 19, kSlotCap = 20, kSendBytes = 21, kRecvBytes = 22, kNonUniformRank = 23, kDroppedAny = 24, kRanksPerNode = 25, kPlanHeader = 26 };

// wire format: byte offsets of the metadata after a row's payload, row sizes
constexpr int64_t kPairsMetaT = 0;
constexpr int64_t kPairsMetaK = 4;
constexpr int64_t kPairsMetaJ = 8;
constexpr int64_t kPairsMetaW = 12;
constexpr int64_t kDedupMetaT = 0;
constexpr int64_t kDedupMetaN = 4;
constexpr int64_t kPairsMetaBytes = 16;
constexpr int64_t kDedupTokMeta = 8;
constexpr int64_t kSlotRowBytes = 8;
constexpr int64_t kSlotKShift = 24;
constexpr int64_t kDedupMaxTopK = 255;
constexpr int64_t kDedupMaxLocal = 16777216;

// payloads: elements per scale along H, bytes per scale (0: no scale)
constexpr int64_t kMxfp8Block = 32;
constexpr int64_t kMxfp8ScaleBytes = 1;
constexpr int64_t kFp8Block128Block = 128;
constexpr int64_t kFp8Block128ScaleBytes = 4;

}  // namespace epkit
